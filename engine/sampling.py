"""Per-request sampling parameters and batched token sampling.

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

    @property
    def greedy(self) -> bool:
        """Argmax decoding (temperature 0); no random draws are made for the row."""
        return self.temperature == 0.0


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
        return torch.tensor(values, dtype=dtype).to(device, non_blocking=True).unsqueeze(1)

    greedy = torch.tensor([p.greedy for p in params]).to(device, non_blocking=True)
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
    if default_rows:
        race[default_rows] = torch.empty(len(default_rows), vocab, device=device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            race[i].exponential_(generator=gen)
    race.clamp_(min=torch.finfo(torch.float32).tiny)
    choice = (probs / race).argmax(dim=-1, keepdim=True)
    sampled = choice.squeeze(1) if sorted_ids is None else sorted_ids.gather(1, choice).squeeze(1)
    return torch.where(greedy, greedy_ids, sampled)
