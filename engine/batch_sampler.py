"""One batch's sampling as the model runner does it: controls (masks, bias, min_tokens, penalties) ->
sample -> logprobs, all on the logits' device; after the step's one host synchronisation, ``finish`` hands
each request its logprobs and advances its grammar.

    logits [B, V] --apply_controls--> processed --sample--> ids [B]
       '--(rows asking for logprobs) gather_logprobs(raw logits, ids)--> read back with the ids
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.logprobs import PendingLogprobs, gather_logprobs, prompt_logprobs
from engine.request import Request
from engine.sampling import RowTokens, apply_controls, sample


class BatchSampler:
    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = eos_token_ids
        self._pending: tuple[list[int], PendingLogprobs] | None = None

    def _banned(self, req: Request) -> frozenset[int]:
        sp = req.sampling
        if not sp.min_tokens or len(req.output_ids) >= sp.min_tokens:
            return frozenset()
        return frozenset(sp.stop_token_ids) | (frozenset() if sp.ignore_eos else self.eos_token_ids)

    def sample(self, logits: torch.Tensor, reqs: Sequence[Request]) -> torch.Tensor:
        """Next token ids [B] on the logits' device (no host synchronisation but the grammar masks' copy)."""
        params = [r.sampling for r in reqs]
        masks = None
        if any(r.grammar is not None for r in reqs):
            masks = torch.ones(logits.shape, dtype=torch.bool)
            for i, r in enumerate(reqs):
                if r.grammar is not None:
                    allowed = r.grammar.allowed()
                    masks[i, :allowed.shape[0]] = allowed
                    masks[i, allowed.shape[0]:] = False
            masks = masks.to(logits.device, non_blocking=True)
        rows = [RowTokens(r.prompt_ids, r.output_ids, self._banned(r)) for r in reqs]
        ids = sample(apply_controls(logits, params, rows, masks), params, [r.generator for r in reqs])
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        self._pending = None
        if want:
            index = torch.tensor(want, device=logits.device)
            self._pending = (want, gather_logprobs(logits.index_select(0, index), ids.index_select(0, index),
                                                   [params[i].logprobs or 0 for i in want]))
        return ids

    def finish(self, reqs: Sequence[Request], tokens: Sequence[int]) -> None:
        """After the ids reached the host: attach the logprobs, advance the grammars."""
        if self._pending is not None:
            want, pending = self._pending
            self._pending = None
            for i, lp in zip(want, pending.to_host([tokens[i] for i in want])):
                reqs[i].output_logprobs.append(lp)
        for r, t in zip(reqs, tokens):
            if r.grammar is not None:
                r.grammar.accept(t)

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
