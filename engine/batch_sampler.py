"""One batch's sampling as the model runner does it: controls (masks, bias, min_tokens, penalties) ->
sample -> logprobs, all on the logits' device; the ids (and logprobs) then start on their way to the host at once,
and ``finish``, once they are there, hands each request its logprobs and advances its grammar.

    logits [B, V] --apply_controls--> processed --sample--> ids [B] --(copy queued now)--> host
       '--(rows asking for logprobs) gather_logprobs(raw logits, ids)--> host, with the ids
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from engine.carried_tokens import CarriedTokens
from engine.device_copy import to_device
from engine.fence import Fence
from engine.logprobs import PendingLogprobs, gather_logprobs, prompt_logprobs
from engine.request import Request
from engine.sampling import RowTokens, apply_controls, sample


@dataclass(frozen=True)
class SampledTokens:
    """One batch's sampled ids: on the device, where a next decode step may read them as its input ids, and on
    their way to the host. The host copies were queued right behind the sampling, so ``wait`` returns once this
    batch is sampled, not once later work queued on the device (the next decode step) is done."""

    ids: torch.Tensor  # [B] int64 on the logits' device
    host_ids: torch.Tensor  # [B] int64 on the host (pinned on CUDA), valid once ``ready`` completes
    logprobs: tuple[list[int], PendingLogprobs] | None  # rows asking for logprobs, and theirs (host copies)
    ready: Fence

    def wait(self) -> list[int]:
        """The ids, on the host (blocks until the batch is sampled)."""
        self.ready.wait()
        return self.host_ids.tolist()


class BatchSampler:
    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = eos_token_ids

    def _banned(self, req: Request, num_pending: int) -> frozenset[int]:
        sp = req.sampling
        if not sp.min_tokens or len(req.output_ids) + num_pending >= sp.min_tokens:
            return frozenset()
        return frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else self.eos_token_ids)

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request], carry: CarriedTokens | None = None) -> SampledTokens:
        """Next token ids of every row (no host synchronisation but the grammar masks' copy). ``carry``: the rows
        whose last sampled token is not in their ``output_ids`` yet (a decode step in flight) and where it is on the
        device; it counts towards ``min_tokens`` and the penalties. A grammar needs every token on the host: the
        scheduler samples a grammar's batch once they are all there (``ModelRunner.sample_decode``)."""
        params = [r.sampling for r in reqs]
        pending = [0] * len(reqs) if carry is None else [int(r >= 0) for r in carry.rows]
        pending_ids = None
        if carry is not None and any(p.has_penalties and n for p, n in zip(params, pending)):
            pending_ids = carry.pending()
        masks = None
        if any(r.grammar is not None and not r.is_finished for r in reqs):
            masks = torch.ones(logits.shape, dtype=torch.bool)
            for i, r in enumerate(reqs):
                if r.grammar is not None and not r.is_finished:  # an ended request's row is dropped when read
                    allowed = r.grammar.allowed()
                    masks[i, :allowed.shape[0]] = allowed
                    masks[i, allowed.shape[0]:] = False
            masks = to_device(masks, logits.device)
        rows = [RowTokens(r.prompt_ids, r.output_ids, self._banned(r, n)) for r, n in zip(reqs, pending)]
        ids = sample(apply_controls(logits, params, rows, masks, pending_ids), params, [r.generator for r in reqs])
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        logprobs = None
        if want:
            index = to_device(want, logits.device, torch.int64)
            logprobs = (want, gather_logprobs(logits.index_select(0, index), ids.index_select(0, index),
                                              [params[i].logprobs or 0 for i in want]).copied_to_host())
        host_ids = ids
        if ids.device.type != "cpu":
            host_ids = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            host_ids.copy_(ids, non_blocking=True)
        return SampledTokens(ids, host_ids, logprobs, Fence(ids.device))

    def finish(self, reqs: Sequence[Request], sampled: SampledTokens,
               keep: Sequence[bool] | None = None) -> list[int]:
        """Wait for the ids on the host; attach the logprobs and advance the grammars of the rows in ``keep``
        (default: every row; a row left out belongs to a request that ended while its step was in flight, and
        its token is dropped). Returns every row's id."""
        tokens = sampled.wait()
        kept = keep if keep is not None else [True] * len(reqs)
        if sampled.logprobs is not None:
            want, pending = sampled.logprobs
            for i, lp in zip(want, pending.to_host([tokens[i] for i in want])):
                if kept[i]:
                    reqs[i].output_logprobs.append(lp)
        for r, t, k in zip(reqs, tokens, kept):
            if k and r.grammar is not None:
                r.grammar.accept(t)
        return tokens

    @staticmethod
    def record_prompt_logprobs(logits_fn, hidden: torch.Tensor, reqs: Sequence[Request],
                               lens: Sequence[int]) -> None:
        """Prompt logprobs of the extend batch's prompt positions not recorded yet (requests asking for them)."""
        start = 0
        for r, n in zip(reqs, lens):
            num_top = r.sampling.prompt_logprobs
            if num_top is not None:
                # position p predicts prompt token p + 1; recorded: positions [0, len(r.prompt_logprobs))
                first = max(r.kv_len, len(r.prompt_logprobs))
                last = min(r.kv_len + n, r.prompt_len - 1)
                if last > first:
                    rows = hidden[start + first - r.kv_len:start + last - r.kv_len]
                    r.prompt_logprobs.extend(prompt_logprobs(logits_fn, rows, r.prompt_ids[first + 1:last + 1],
                                                             num_top))
            start += n
