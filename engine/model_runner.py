"""Runs the model over one extend batch or one decode batch and samples the next tokens."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.attention_paths import AttentionPaths, ExtendSeq, LayerHook
from engine.model import CausalLM
from engine.request import Request
from engine.sampling import sample


class ModelRunner:
    def __init__(self, model: CausalLM, paths: AttentionPaths, device: torch.device):
        self.model = model
        self.paths = paths
        self.device = device

    @torch.inference_mode()
    def extend(
        self, reqs: Sequence[Request], lens: Sequence[int], sample_mask: Sequence[bool],
        on_layer_done: LayerHook | None = None,
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
        hidden = self.model(input_ids, positions, self.paths.extend(seqs, on_layer_done))
        want = [i for i, m in enumerate(sample_mask) if m]
        result: list[int | None] = [None] * len(reqs)
        if not want:
            return result
        ends = torch.tensor(lens, dtype=torch.long).cumsum(0) - 1
        rows = ends[want].to(self.device)
        tokens = self._sample(hidden[rows], [reqs[i] for i in want])
        for i, t in zip(want, tokens):
            result[i] = t
        return result

    @torch.inference_mode()
    def decode(self, reqs: Sequence[Request]) -> list[int]:
        """One token per request: write the K/V of its last token at position kv_len, sample the next."""
        page_size = self.paths.pool.layers[0].page_size
        max_pages = max(len(r.page_ids) for r in reqs)
        table = torch.zeros((len(reqs), max_pages), dtype=torch.int32)
        for i, r in enumerate(reqs):
            table[i, :len(r.page_ids)] = torch.tensor(r.page_ids, dtype=torch.int32)
        seq_lens = torch.tensor([r.kv_len + 1 for r in reqs], dtype=torch.int32)
        out_slots = torch.cat([self.paths.pool.slots_for(r.page_ids, r.kv_len, r.kv_len + 1) for r in reqs])
        assert all(r.kv_len < len(r.page_ids) * page_size for r in reqs), "decode slot without a page"
        input_ids = torch.tensor([r.tokens[r.kv_len] for r in reqs], dtype=torch.long, device=self.device)
        positions = torch.tensor([r.kv_len for r in reqs], dtype=torch.long, device=self.device)
        attn = self.paths.decode(table.to(self.device), seq_lens.to(self.device), out_slots.to(self.device))
        hidden = self.model(input_ids, positions, attn)
        return self._sample(hidden, reqs)

    def _sample(self, hidden: torch.Tensor, reqs: Sequence[Request]) -> list[int]:
        logits = self.model.compute_logits(hidden)
        return sample(logits, [r.sampling for r in reqs], [r.generator for r in reqs]).tolist()
