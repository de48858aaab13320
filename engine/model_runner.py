"""Runs the model over one extend batch or one decode batch and samples the next tokens."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from engine.attention_paths import AttentionPaths, ExtendSeq
from engine.batch_sampler import BatchSampler, SampledTokens
from engine.carried_tokens import CarriedTokens
from engine.decode_graphs import DecodeGraphRunner
from engine.device_copy import to_device
from engine.model import CausalLM
from engine.request import Request


class ModelRunner:
    def __init__(self, model: CausalLM, paths: AttentionPaths, device: torch.device,
                 graphs: DecodeGraphRunner | None = None, eos_token_ids: frozenset[int] = frozenset()):
        self.model = model
        self.sampler = BatchSampler(eos_token_ids)  # controls, sampling, logprobs and grammars of a batch
        self.paths = paths
        self.device = device
        self.graphs = graphs  # fixed-buffer (CUDA graph) decode; None: every decode step runs eagerly
        self._tables = PageTableRows()
        self.decode_wait_s = 0.0  # total time decode() has blocked on the device for its sampled tokens

    @torch.inference_mode()
    def extend(
        self, reqs: Sequence[Request], lens: Sequence[int], sample_mask: Sequence[bool],
    ) -> list[int | None]:
        """Compute K/V of tokens [kv_len, kv_len + n) of each request; sample the next token for the
        requests whose ``sample_mask`` is set (from the logits of their last extended position)."""
        seqs = [ExtendSeq(r.page_ids, r.kv_len, n) for r, n in zip(reqs, lens)]
        ids, pos = [], []
        for r, n in zip(reqs, lens):
            ids.extend(r.tokens[r.kv_len:r.kv_len + n])
            pos.extend(range(r.kv_len, r.kv_len + n))
        input_ids = torch.tensor(ids, dtype=torch.long, device=self.device)
        positions = torch.tensor(pos, dtype=torch.long, device=self.device)
        hidden = self.model(input_ids, positions, self.paths.extend(seqs))
        if any(r.sampling.prompt_logprobs is not None for r in reqs):
            self.sampler.record_prompt_logprobs(self.model.compute_logits, hidden, reqs, lens)
        want = [i for i, m in enumerate(sample_mask) if m]
        result: list[int | None] = [None] * len(reqs)
        if not want:
            return result
        ends = torch.tensor(lens, dtype=torch.long).cumsum(0) - 1
        rows = ends[want].to(self.device)
        sampled = [reqs[i] for i in want]
        tokens = self.sampler.finish(sampled, self.sampler.sample(self.model.compute_logits(hidden[rows]), sampled))
        for i, t in zip(want, tokens):
            result[i] = t
        return result

    @torch.inference_mode()
    def decode(self, reqs: Sequence[Request], on_launched: Callable[[], None] | None = None) -> list[int]:
        """One token per request: write the K/V of its last token at position kv_len, sample the next.

        ``on_launched`` runs once the step's device work is queued and before waiting for its tokens: host
        work done there (streaming the previous step's tokens) overlaps the GPU instead of delaying it."""
        sampled = self.launch_decode(reqs)
        if on_launched is not None:
            on_launched()
        return self.finish_decode(reqs, sampled)

    @torch.inference_mode()
    def launch_decode(self, reqs: Sequence[Request], carry: CarriedTokens | None = None) -> SampledTokens:
        """``decode``'s device work, queued, without waiting for it: the sampled ids stay on the device (where the
        next step may read them: its ``carry``) and are on their way to the host. ``carry``: the rows whose last
        token is the previous step's sampled id, not in their ``output_ids`` yet."""
        return self.sample_decode(self.decode_logits(reqs, carry=carry), reqs, carry)

    @torch.inference_mode()
    def sample_decode(self, logits: torch.Tensor, reqs: Sequence[Request],
                      carry: CarriedTokens | None = None) -> SampledTokens:
        """The sampling of a decode step whose forward (``decode_logits``) is queued; the logits must not have been
        overwritten by a later forward. Rows of requests that ended meanwhile are sampled unconstrained (their
        tokens are dropped when read)."""
        return self.sampler.sample(logits, reqs, carry)

    def finish_decode(self, reqs: Sequence[Request], sampled: SampledTokens,
                      keep: Sequence[bool] | None = None) -> list[int]:
        """The ids of a launched step, on the host (the one host synchronisation of a decode step); logprobs and
        grammars of the rows in ``keep`` (default: all) advanced (``BatchSampler.finish``)."""
        t0 = time.perf_counter()
        tokens = self.sampler.finish(reqs, sampled, keep)
        self.decode_wait_s += time.perf_counter() - t0
        return tokens

    @torch.inference_mode()
    def decode_logits(self, reqs: Sequence[Request], use_graphs: bool = True,
                      carry: CarriedTokens | None = None) -> torch.Tensor:
        """The decode forward of ``decode``: logits [B, vocab] fp32 (the fixed-buffer / CUDA-graph path when
        the batch fits it and ``use_graphs``, else eager). A row of ``carry`` reads its input id on the device."""
        ps = self.paths.pool.layers[0].page_size
        tables = self._tables.rows(reqs)
        assert all(r.kv_len < len(t) * ps for r, t in zip(reqs, tables)), "decode slot without a page"
        carried = carry.rows if carry is not None else [-1] * len(reqs)
        ids = [r.token_at(r.kv_len) if c < 0 else 0 for r, c in zip(reqs, carried)]
        pos = [r.kv_len for r in reqs]
        lens = [r.kv_len + 1 for r in reqs]
        slots = [int(t[r.kv_len // ps]) * ps + r.kv_len % ps for r, t in zip(reqs, tables)]
        width = max(len(t) for t in tables)
        if use_graphs and self.graphs is not None and self.graphs.supports(len(reqs), width):
            # append_only: the tables are PageTableRows' rows, which only grow
            return self.graphs.run(ids, pos, tables, lens, slots, append_only=True, carry=carry)
        table = np.zeros((len(reqs), width), dtype=np.int32)
        for i, t in enumerate(tables):
            table[i, :len(t)] = t
        dev = self.device  # host -> device without waiting for a step still in flight (engine/device_copy.py)
        attn = self.paths.decode(to_device(torch.from_numpy(table), dev), to_device(lens, dev, torch.int32),
                                 to_device(slots, dev, torch.int64), self.model.dtype)
        input_ids = to_device(ids, dev, torch.int64)
        if carry is not None:
            carry.fill(input_ids, to_device(list(carry.rows), dev, torch.int64))
        hidden = self.model(input_ids, to_device(pos, dev, torch.int64), attn)
        return self.model.compute_logits(hidden)


class PageTableRows:
    """Each decoding request's page ids as an int32 array, kept across steps and grown in place.

    Invariant relied on: the scheduler only appends to a request's ``page_ids`` list, or replaces the list
    object. A cached row is reused while it belongs to the same list object (held here, so its id cannot
    be recycled) and only the new tail is converted; rows of requests absent from a step are dropped.
    """

    def __init__(self) -> None:
        self._rows: dict[str, tuple[list[int], np.ndarray, int]] = {}

    def rows(self, reqs: Sequence[Request]) -> list[np.ndarray]:
        out, kept = [], {}
        for r in reqs:
            ids = r.page_ids
            cached = self._rows.get(r.rid)
            if cached is None or cached[0] is not ids:
                arr, n = np.empty(max(16, 2 * len(ids)), dtype=np.int32), 0
            else:
                _, arr, n = cached
            if len(ids) > n:
                if len(ids) > arr.shape[0]:
                    grown = np.empty(2 * len(ids), dtype=np.int32)
                    grown[:n] = arr[:n]
                    arr = grown
                arr[n:len(ids)] = ids[n:]
            kept[r.rid] = (ids, arr, len(ids))
            out.append(arr[:len(ids)])
        self._rows = kept
        return out
