"""A by-reference transfer's batched page refs (decode_svc/page_refs.py): one writer task copies a run of pages
of every layer out of the prefill's pool, as the per-layer copies did, on the CPU and, where there is one, on a
GPU (its page-copy launches)."""

from __future__ import annotations

import random

import pytest
import torch

from decode_svc.page_refs import PageRead, copy_batch
from svc_common.kv_transfer_ipc import pool_view
from svc_common.page_import import PageImporter
from tests.test_kv_copy import DEVICES, _pool, _rows


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3", "bf16"])
def test_a_batch_copies_every_layers_pages_and_checks_their_values(device, kv_dtype):
    src, dst = _pool(kv_dtype, device), _pool(kv_dtype, device)
    for layer in dst.layers:  # the same seed as src: make every destination byte differ from its source first
        for t in (layer.k, layer.k_sf, layer.v, layer.v_sf):
            if t is not None:
                t.view(torch.uint8).fill_(0x01)
    rnd = random.Random(2)
    src_pages, dst_pages = rnd.sample(range(64), 9), rnd.sample(range(64), 9)
    before = [_rows(dst, layer, [p for p in range(64) if p not in dst_pages]) for layer in range(2)]
    importer = PageImporter(dst)
    copy_batch(importer, pool_view(src), [PageRead(layer, src_pages, dst_pages, 9 * 4) for layer in range(2)])
    importer.finish()
    for layer in range(2):
        for a, b in zip(_rows(src, layer, src_pages), _rows(dst, layer, dst_pages), strict=True):
            assert torch.equal(a, b)
        others = _rows(dst, layer, [p for p in range(64) if p not in dst_pages])  # nothing else was written
        assert all(torch.equal(a, b) for a, b in zip(before[layer], others, strict=True))
    if kv_dtype == "bf16":
        return
    e4m3 = src.layers[1].k_sf if kv_dtype == "nvfp4" else src.layers[1].k  # nvfp4: its scales are E4M3
    e4m3.view(torch.uint8)[src_pages[4]].fill_(0x7F)  # an E4M3 NaN in the prompt's slots of layer 1
    importer = PageImporter(dst)
    copy_batch(importer, pool_view(src), [PageRead(layer, src_pages, dst_pages, 9 * 4) for layer in range(2)])
    with pytest.raises(ValueError, match="NaN or inf"):
        importer.finish()


def test_a_refs_message_names_its_layers_within_the_layout():
    from decode_svc.page_refs import layers_of
    assert list(layers_of(0, 8, 8)) == list(range(8))  # every layer of a run in one message
    assert list(layers_of(3, 0, 8)) == [3] and list(layers_of(3, 1, 8)) == [3]  # one layer (an older prefill's)
    for layer, n in ((0, 9), (7, 2), (-1, 1), (8, 0), (2, -1)):
        with pytest.raises(ValueError, match="outside the layout's 8"):
            layers_of(layer, n, 8)


def test_page_reads_past_a_batch_go_to_several_writer_tasks_in_order():
    from decode_svc.page_refs import MAX_BATCH, PageRead, batches_of
    reads = [PageRead(layer, [1, 2], [3, 4], 8) for layer in range(MAX_BATCH * 2 + 3)]  # e.g. a 131-layer model
    parts = batches_of(reads)
    assert [len(p) for p in parts] == [MAX_BATCH, MAX_BATCH, 3]
    assert [r.layer for p in parts for r in p] == list(range(len(reads)))
    assert batches_of([]) == []
