"""Token logprobs from logits already on the device: no extra forward, one host copy per step.

Values are ``log_softmax`` of the model's raw logits (before temperature, penalties or masks), as vLLM reports
them by default: the sampled token's logprob and the ``num_top`` most likely tokens at that position.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch

PROMPT_ROWS_PER_PASS = 256  # prompt positions turned into [rows, vocab] logprobs at once (bounds the memory)


class TokenLogprob(NamedTuple):
    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...]  # (token id, logprob), most likely first


class PendingLogprobs(NamedTuple):
    """Device tensors of one batch's logprobs, read back after the step's one synchronisation."""

    chosen: torch.Tensor  # [R] float32
    top_values: torch.Tensor | None  # [R, K]
    top_ids: torch.Tensor | None  # [R, K]
    num_top: tuple[int, ...]  # per row, <= K

    def copied_to_host(self) -> PendingLogprobs:
        """The same logprobs copied into host memory without blocking (pinned on CUDA): the copies are queued behind
        the work that computes them, so reading them after that work's fence never waits for later steps."""
        def host(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device.type == "cpu":
                return t
            out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            out.copy_(t, non_blocking=True)
            return out

        return PendingLogprobs(host(self.chosen), host(self.top_values), host(self.top_ids), self.num_top)

    def to_host(self, token_ids: Sequence[int]) -> list[TokenLogprob]:
        chosen = self.chosen.tolist()
        values = self.top_values.tolist() if self.top_values is not None else None
        ids = self.top_ids.tolist() if self.top_ids is not None else None
        out = []
        for i, (tok, lp, k) in enumerate(zip(token_ids, chosen, self.num_top)):
            top = tuple(zip(ids[i][:k], values[i][:k])) if k and ids is not None else ()
            out.append(TokenLogprob(int(tok), float(lp), top))
        return out


def gather_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> PendingLogprobs:
    """Logprobs of ``token_ids [R]`` under ``logits [R, V]`` and the top ``num_top[r]`` of each row (device)."""
    lp = logits.float().log_softmax(dim=-1)
    chosen = lp.gather(1, token_ids.view(-1, 1).to(lp.device)).squeeze(1)
    k = max(num_top, default=0)
    if k:
        values, ids = lp.topk(min(k, lp.shape[1]), dim=-1)
        return PendingLogprobs(chosen, values, ids, tuple(num_top))
    return PendingLogprobs(chosen, None, None, tuple(num_top))


def prompt_logprobs(logits_fn, hidden: torch.Tensor, targets: Sequence[int], num_top: int) -> list[TokenLogprob]:
    """Logprobs of ``targets[i]`` predicted from ``hidden[i]`` (prompt positions), a pass per slice of rows."""
    out: list[TokenLogprob] = []
    for start in range(0, len(targets), PROMPT_ROWS_PER_PASS):
        stop = min(start + PROMPT_ROWS_PER_PASS, len(targets))
        ids = torch.tensor(list(targets[start:stop]), dtype=torch.long, device=hidden.device)
        pending = gather_logprobs(logits_fn(hidden[start:stop]), ids, [num_top] * (stop - start))
        out.extend(pending.to_host(targets[start:stop]))
    return out
