"""Per-request sampling parameters and batched token sampling.

``apply_controls`` changes a batch's logits in one batched pass on their device, each row by its own
request's controls (rows without any are untouched; a batch with none costs nothing), in this order:
token masks (structured output), logit_bias, the min_tokens ban of EOS / stop ids, then the penalties
(repetition over prompt + output ids as in vLLM/HF: a positive logit divided by it, a negative one
multiplied; frequency and presence over the output ids, as OpenAI: ``l -= f * count + p * (count > 0)``).

``sample`` handles a batch whose rows have different parameters in one pass on the logits'
device: greedy rows take the argmax; the others go temperature -> top-k -> top-p -> min-p and
draw with the exponential race ``argmax(p / E)``, ``E ~ Exp(1)``, which picks index i with
probability p_i. Each row's E comes from that row's generator (seeded rows are reproducible)
or from the default generator; nothing is copied to the host except the returned ids.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.device_copy import to_device

MAX_LOGPROBS = 20  # as vLLM's default --max-logprobs and OpenAI's top_logprobs bound


@dataclass(frozen=True)
class SamplingParams:
    """How to pick the tokens of one request (OpenAI-style semantics; temperature 0 is greedy)."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # <= 0: disabled
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # (0, 2]; 1 disables it
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias in [-100, 100]) pairs
    min_tokens: int = 0  # EOS and stop_token_ids are banned until this many tokens were generated
    logprobs: int | None = None  # with each sampled token: its logprob and the top-N (0..20) alternatives
    prompt_logprobs: int | None = None  # the same for every prompt token (the prompt runs uncached)

    def __post_init__(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number (got {value!r})")
            return float(value)

        if not 0.0 <= number("temperature") <= 2.0:
            raise ValueError(f"temperature must be in [0, 2] (got {self.temperature}); use 0 for greedy decoding")
        if not 0.0 < number("top_p") <= 1.0:
            raise ValueError(f"top_p must be in (0, 1] (got {self.top_p}); use 1 to disable it")
        if not 0.0 <= number("min_p") <= 1.0:
            raise ValueError(f"min_p must be in [0, 1] (got {self.min_p}); use 0 to disable it")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise TypeError(f"top_k must be an integer (got {self.top_k!r}); use -1 to disable it")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1 (got {self.max_tokens!r})")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed < 2**64
        ):
            raise ValueError(f"seed must be an integer in [0, 2**64) or None (got {self.seed!r})")
        stop = tuple(self.stop_token_ids)
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop):
            raise ValueError(f"stop_token_ids must be non-negative integers (got {self.stop_token_ids!r})")
        object.__setattr__(self, "stop_token_ids", stop)
        if not isinstance(self.ignore_eos, bool):
            raise TypeError(f"ignore_eos must be a bool (got {self.ignore_eos!r})")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2.0 <= number(name) <= 2.0:
                raise ValueError(f"{name} must be in [-2, 2] (got {getattr(self, name)}); use 0 to disable it")
        if not 0.0 < number("repetition_penalty") <= 2.0:
            raise ValueError(f"repetition_penalty must be in (0, 2] (got {self.repetition_penalty}); use 1 to "
                             f"disable it")
        bias = tuple((int(t), float(b)) for t, b in self.logit_bias)
        if any(t < 0 or not -100.0 <= b <= 100.0 or not math.isfinite(b) for t, b in bias):
            raise ValueError(f"logit_bias needs token ids >= 0 and biases in [-100, 100] (got {self.logit_bias!r})")
        object.__setattr__(self, "logit_bias", bias)
        if isinstance(self.min_tokens, bool) or not isinstance(self.min_tokens, int) or \
                not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}] "
                             f"(got {self.min_tokens!r})")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or not 0 <= value <= MAX_LOGPROBS):
                raise ValueError(f"{name} must be an integer in [0, {MAX_LOGPROBS}] or None (got {value!r})")

    @property
    def greedy(self) -> bool:
        """Argmax decoding (temperature 0); no random draws are made for the row."""
        return self.temperature == 0.0

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def make_generator(seed: int | None, device: torch.device | str) -> torch.Generator | None:
    """A generator seeded with ``seed`` on ``device``; None when the request has no seed."""
    if seed is None:
        return None
    gen = torch.Generator(device=torch.device(device))
    gen.manual_seed(seed)
    return gen


def sample(logits: torch.Tensor, params: Sequence[SamplingParams],
           generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """Token ids ``[B]`` int64 on the logits' device for logits ``[B, V]`` float32, one params per row."""
    if logits.dim() != 2 or logits.shape[0] != len(params) or len(generators) != len(params):
        raise ValueError(f"sample needs logits [B, V] with B == len(params) == len(generators) "
                         f"(got {tuple(logits.shape)}, {len(params)} params, {len(generators)} generators)")
    vocab = logits.shape[1]
    device = logits.device
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1)
    if all(p.greedy for p in params):
        return greedy_ids

    def column(values: list[float], dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return to_device(values, device, dtype).unsqueeze(1)

    greedy = to_device([p.greedy for p in params], device, torch.bool)
    temperature = column([p.temperature if not p.greedy else 1.0 for p in params])
    top_k = column([p.top_k if p.top_k > 0 else vocab for p in params], torch.int64)
    top_p = column([p.top_p if p.top_p < 1.0 else math.inf for p in params])  # inf: no float-rounding cut
    min_p = column([p.min_p for p in params])

    if all(p.top_k <= 0 and p.top_p >= 1.0 and p.min_p == 0.0 for p in params):
        # No filter: race over the vocabulary in id order (no sort; the same distribution).
        probs, sorted_ids = (logits / temperature).softmax(dim=-1), None
    else:
        sorted_logits, sorted_ids = (logits / temperature).sort(dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device).unsqueeze(0)
        sorted_logits = sorted_logits.masked_fill(ranks >= top_k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        # top-p: keep the shortest prefix whose mass reaches top_p (the first token always stays)
        mass_before = probs.cumsum(dim=-1) - probs
        probs = probs.masked_fill(mass_before >= top_p, 0.0)
        # min-p: drop tokens below min_p times the most likely token's probability
        probs = probs.masked_fill(probs < min_p * probs[:, :1], 0.0)

    race = torch.empty_like(probs)
    default_rows = [i for i, g in enumerate(generators) if g is None]
    if len(default_rows) == len(generators):
        race.exponential_()
    elif default_rows:
        race.index_copy_(0, to_device(default_rows, device, torch.int64),
                         torch.empty(len(default_rows), vocab, device=device).exponential_())
    for i, gen in enumerate(generators):
        if gen is not None:
            race[i].exponential_(generator=gen)
    race.clamp_(min=torch.finfo(torch.float32).tiny)
    choice = (probs / race).argmax(dim=-1, keepdim=True)
    sampled = choice.squeeze(1) if sorted_ids is None else sorted_ids.gather(1, choice).squeeze(1)
    return torch.where(greedy, greedy_ids, sampled)


@dataclass(frozen=True)
class RowTokens:
    """What ``apply_controls`` needs to know of one row's request beyond its params."""

    prompt_ids: Sequence[int]
    output_ids: Sequence[int]
    banned_until_min: frozenset[int] = frozenset()  # EOS + stop ids, banned while len(output) < min_tokens


def _padded(rows: list[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    out = torch.full((len(rows), width), pad, dtype=torch.int64)
    for i, r in enumerate(rows):
        if len(r):
            out[i, :len(r)] = torch.as_tensor(list(r), dtype=torch.int64)
    return to_device(out, device)


def apply_controls(logits: torch.Tensor, params: Sequence[SamplingParams], rows: Sequence[RowTokens],
                   token_masks: torch.Tensor | None = None, pending: torch.Tensor | None = None) -> torch.Tensor:
    """``logits [B, V]`` float32 with every row's controls applied (a new tensor; the input is untouched
    unless no row has any control, in which case it is returned as is). ``token_masks``: bool [B, V], True
    where a token is allowed (structured output), or None. ``pending``: int64 [B] on the logits' device, each row's
    output token that is not in its ``output_ids`` yet (a decode step in flight), -1 for none: the penalties count
    it as an output token, on the device."""
    if len(rows) != len(params) or logits.shape[0] != len(params):
        raise ValueError(f"apply_controls needs one RowTokens and one params per row (got {logits.shape[0]} rows, "
                         f"{len(params)} params, {len(rows)} RowTokens)")
    vocab, device = logits.shape[1], logits.device
    biased = [i for i, p in enumerate(params) if p.logit_bias]
    banned = [i for i, (p, r) in enumerate(zip(params, rows))
              if p.min_tokens and len(r.output_ids) < p.min_tokens and r.banned_until_min]
    penalised = [i for i, p in enumerate(params) if p.has_penalties]
    if token_masks is None and not (biased or banned or penalised):
        return logits
    out = logits.float().clone()
    if token_masks is not None:
        out.masked_fill_(~token_masks, float("-inf"))
    if biased or banned:  # one sparse scatter: (row, id, value) triples
        r_idx, t_idx, vals = [], [], []
        for i in biased:
            for t, b in params[i].logit_bias:
                if t < vocab:
                    r_idx.append(i), t_idx.append(t), vals.append(b)
        for i in banned:
            for t in rows[i].banned_until_min:
                if t < vocab:
                    r_idx.append(i), t_idx.append(t), vals.append(float("-inf"))
        if r_idx:
            out.index_put_((to_device(r_idx, device, torch.int64), to_device(t_idx, device, torch.int64)),
                           to_device(vals, device, torch.float32), accumulate=True)
    if penalised:
        rows_p = to_device(penalised, device, torch.int64)
        sub = out.index_select(0, rows_p)
        pen = [params[i] for i in penalised]
        reps = [p.repetition_penalty for p in pen]
        extra = None  # [P, 1]: each penalised row's pending output id, or the padding id ``vocab``
        if pending is not None:
            p_ids = pending.index_select(0, rows_p)
            extra = torch.where(p_ids >= 0, p_ids, vocab).unsqueeze(1)
        if any(r != 1.0 for r in reps):
            seen_ids = _padded([[*rows[i].prompt_ids, *rows[i].output_ids] for i in penalised], vocab, device)
            if extra is not None:
                seen_ids = torch.cat([seen_ids, extra], dim=1)
            seen = torch.zeros(len(penalised), vocab + 1, dtype=torch.bool, device=device)
            seen.scatter_(1, seen_ids, True)
            seen = seen[:, :vocab]
            rep = to_device(reps, device, torch.float32).unsqueeze(1)
            sub = torch.where(seen, torch.where(sub > 0, sub / rep, sub * rep), sub)
        if any(p.presence_penalty or p.frequency_penalty for p in pen):
            out_ids = _padded([rows[i].output_ids for i in penalised], vocab, device)
            if extra is not None:
                out_ids = torch.cat([out_ids, extra], dim=1)
            counts = torch.zeros(len(penalised), vocab + 1, dtype=torch.float32, device=device)
            counts.scatter_add_(1, out_ids, torch.ones_like(out_ids, dtype=torch.float32))
            counts = counts[:, :vocab]
            freq = to_device([p.frequency_penalty for p in pen], device, torch.float32).unsqueeze(1)
            pres = to_device([p.presence_penalty for p in pen], device, torch.float32).unsqueeze(1)
            sub = sub - freq * counts - pres * (counts > 0).float()
        out.index_copy_(0, rows_p, sub)
    return out
