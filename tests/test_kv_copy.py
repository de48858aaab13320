"""PageExporter / PageImporter (svc_common/page_export.py, svc_common/page_import.py) against plain tensor
indexing, on the CPU and, where there is one, on a GPU (its side streams, pinned copies and gather kernels)."""

from __future__ import annotations

import random

import pytest
import torch

from engine.kv_pool import KVPool
from svc_common.kv_transfer_ipc import pool_view
from svc_common.kv_wire import decode_page_run
from svc_common.page_export import PageExporter
from svc_common.page_import import PageImporter
from svc_common.pool_parts import PARTS

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs CUDA")])]


def _pool(kv_dtype: str, device: str, pages: int = 64) -> KVPool:
    pool = KVPool(kv_dtype, 2, pages, 4, 2, 32, device=device)
    g = torch.Generator().manual_seed(0)
    for layer in pool.layers:
        for t in (layer.k, layer.k_sf, layer.v, layer.v_sf):
            if t is not None:  # E4M3 bytes below 0x7F: finite values and scales
                raw = t.view(torch.uint8)
                raw.copy_(torch.randint(0, 0x7F, raw.shape, generator=g, dtype=torch.uint8))
    return pool


def _rows(pool: KVPool, layer: int, pages: list[int]) -> list[torch.Tensor]:
    lkv = pool.layers[layer]
    return [t.view(torch.uint8)[pages].cpu() for t in (lkv.k, lkv.k_sf, lkv.v, lkv.v_sf) if t is not None]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3", "bf16"])
def test_messages_then_writes_move_every_byte_of_scattered_pages(device, kv_dtype):
    src, dst = _pool(kv_dtype, device), _pool(kv_dtype, device)
    for layer in dst.layers:
        for t in (layer.k, layer.k_sf, layer.v, layer.v_sf):
            if t is not None:
                t.view(torch.uint8).zero_()
    rnd = random.Random(1)
    src_pages = rnd.sample(range(64), 21)  # scattered: more runs than are copied slice by slice
    dst_pages = list(range(30, 40)) + rnd.sample(range(30), 11)
    exporter, importer = PageExporter(pool_view(src)), PageImporter(dst)
    for layer in range(2):
        msgs = exporter.messages("r", layer, 5, src_pages, 4, None)
        assert len(msgs) == 6  # 21 pages, 4 per message
        for msg in msgs:
            run = decode_page_run(msg)
            assert run.request_id == "r" and run.layer == layer
            seq = run.first_page - 5
            importer.write(run, dst_pages[seq:seq + run.num_pages], run.num_pages * 4)
    importer.finish()
    for layer in range(2):
        for a, b in zip(_rows(src, layer, src_pages), _rows(dst, layer, dst_pages), strict=True):
            assert torch.equal(a, b)
    times = importer.times  # the transfer log line's breakdown of the writes
    assert times.writes == 12 and min(times.stage_s, times.lock_wait_s, times.launch_s) >= 0
    assert times.summary().startswith(" (12 writes: ") and "waiting for the lock" in times.summary()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3", "bf16"])
@pytest.mark.parametrize("run_copies", [True, False], ids=["run-copies", "launch-per-message"])
def test_a_transfer_written_in_runs_equals_one_launch_per_message_and_finish_checks_it_once(device, kv_dtype,
                                                                                          run_copies):
    """Messages into a few runs of consecutive pages are plain copies (on a GPU copy-engine work, no kernel per
    message); ``finish`` checks the whole transfer's prompt slots: a NaN in the last, partial page fails it only
    inside the prompt, as does one in a full page of the middle. The same transfer through one launch per message
    (``use_run_copies(False)``, and the CPU's reference) gives the same pages and the same verdicts."""
    src, dst = _pool(kv_dtype, device), _pool(kv_dtype, device, pages=96)
    src_pages = list(range(10, 23))  # 13 pages: 3 messages of 5, 5 and 3 pages per layer
    dst_pages = list(range(70, 78)) + [3, 4, 5, 6, 90]  # three runs, the last page on its own
    num_tokens = 12 * 4 + 2  # the last page holds 2 prompt tokens

    def transfer(num_tokens: int) -> PageImporter:
        imp = PageImporter(dst)
        imp.use_run_copies(run_copies)
        exporter = PageExporter(pool_view(src))
        for layer in range(2):
            for msg in exporter.messages("r", layer, 0, src_pages, 5, None):
                run = decode_page_run(msg)
                pages = dst_pages[run.first_page:run.first_page + run.num_pages]
                imp.write(run, pages, min(num_tokens, (run.first_page + run.num_pages) * 4) - run.first_page * 4)
        return imp

    transfer(num_tokens).finish()
    for layer in range(2):
        for a, b in zip(_rows(src, layer, src_pages), _rows(dst, layer, dst_pages), strict=True):
            assert torch.equal(a, b)
    part = "k_sf" if kv_dtype == "nvfp4" else "v"
    nan = 0x7F if kv_dtype != "bf16" else None
    t = getattr(src.layers[1], part).view(torch.uint8)
    for page, slot, tokens_ok in ((22, 2, num_tokens), (16, 1, 6 * 4 + 1)):  # last page slot 2; page 7 slot 1
        saved = t[page].clone()
        if nan is None:  # bf16 +inf: 0x7F80 little-endian
            t[page, slot].view(-1)[:2] = torch.tensor([0x80, 0x7F], dtype=torch.uint8, device=t.device)
        else:
            t[page, slot].view(-1)[0] = nan
        if tokens_ok == num_tokens:  # slot 2 of the last page is past a prompt that ends at its slot 2
            transfer(num_tokens).finish()
            with pytest.raises(ValueError, match="NaN or inf"):
                transfer(num_tokens + 1).finish()
        else:  # a full page of the middle: always inside the prompt
            with pytest.raises(ValueError, match="NaN or inf"):
                transfer(num_tokens).finish()
        t[page].copy_(saved)
    if run_copies:
        # the copies staged every message and wrote nothing with a launch (no page-copy call)
        imp = transfer(num_tokens)
        assert imp.times.writes == 6 and len(imp._unchecked) == 6
        imp.finish()
        assert imp._unchecked == []


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3"])
def test_pages_in_runs_go_to_host_in_the_gathers_layout(device, kv_dtype):
    """A GPU export of pages in a few runs copies each run of each part to host (no gather kernel): the host
    buffer it fills is byte for byte the part-after-part layout of a gather of the same pages, and the messages
    made from it carry the pages (on a GPU through ``messages``, on the CPU through the copy helper itself)."""
    from svc_common.kv_transfer_ipc import page_runs
    from svc_common.page_export import _copy_runs_to_host

    src = _pool(kv_dtype, device)
    ids = list(range(40, 47)) + list(range(3, 12)) + [60]  # three runs, out of pool order
    parts = [t for t in (src.layers[1].k, src.layers[1].k_sf, src.layers[1].v, src.layers[1].v_sf)]
    sizes = [0 if t is None else len(ids) * t[0].numel() * t.element_size() for t in parts]
    host = torch.empty(sum(sizes), dtype=torch.uint8, pin_memory=device == "cuda")
    _copy_runs_to_host(parts, sizes, page_runs(ids, list(range(len(ids)))), host)
    if device == "cuda":
        torch.cuda.synchronize()
    want = torch.cat([t.view(torch.uint8).view(t.shape[0], -1)[ids].reshape(-1).cpu() for t in parts if t is not None])
    assert torch.equal(host, want)
    if device == "cuda":  # the exporter takes this path for these pages
        msgs = PageExporter(pool_view(src)).messages("r", 1, 0, ids, 5, None)
        got = [bytes(p) for msg in msgs for p in decode_page_run(msg).parts]
        rows = _rows(src, 1, ids)
        assert b"".join(got) == b"".join(bytes(r[i:i + 5].reshape(-1).numpy()) for i in range(0, len(ids), 5)
                                         for r in rows)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("scattered", [False, True])
def test_copy_from_another_pool_equals_indexing(device, scattered):
    src, dst = _pool("nvfp4", device), _pool("nvfp4", device, pages=128)
    rnd = random.Random(2)
    src_pages = rnd.sample(range(64), 40)
    dst_pages = rnd.sample(range(128), 40) if scattered else list(range(77, 117))
    importer = PageImporter(dst)
    for layer in range(2):
        lkv = src.layers[layer]
        importer.copy_from([lkv.k, lkv.k_sf, lkv.v, lkv.v_sf], layer, src_pages, dst_pages, 40 * 4)
    importer.finish()
    for layer in range(2):
        for a, b in zip(_rows(src, layer, src_pages), _rows(dst, layer, dst_pages), strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3"])
def test_copy_from_layers_moves_the_same_pages_of_every_layer_and_checks_them(device, kv_dtype):
    """cuda-ipc's batch: a run of pages of every layer in one call (on a GPU one launch per kind of part)."""
    src, dst = _pool(kv_dtype, device), _pool(kv_dtype, device, pages=128)
    rnd = random.Random(3)
    src_pages, dst_pages = rnd.sample(range(64), 40), rnd.sample(range(128), 40)
    parts = [[lkv.k, lkv.k_sf, lkv.v, lkv.v_sf] for lkv in src.layers]
    importer = PageImporter(dst)
    importer.copy_from_layers(parts, [0, 1], src_pages, dst_pages, 40 * 4)
    importer.finish()
    for layer in range(2):
        for a, b in zip(_rows(src, layer, src_pages), _rows(dst, layer, dst_pages), strict=True):
            assert torch.equal(a, b)
    # a NaN in layer 1's prompt slots fails the batch; the same NaN past the prompt does not
    bad = src.layers[1].k_sf if kv_dtype == "nvfp4" else src.layers[1].v
    bad.view(torch.uint8)[src_pages[2], 3] = 0x7F  # page 2 of the run, token slot 3: the prompt's 12th token
    ok = PageImporter(dst)
    ok.copy_from_layers(parts, [0, 1], src_pages[:3], dst_pages[:3], 11)
    ok.finish()
    failed = PageImporter(dst)
    failed.copy_from_layers(parts, [0, 1], src_pages[:3], dst_pages[:3], 12)
    with pytest.raises(ValueError, match="NaN"):
        failed.finish()


@pytest.mark.parametrize("device", DEVICES)
def test_a_nan_scale_in_the_prompt_fails_the_copy_and_one_past_it_does_not(device):
    src, dst = _pool("nvfp4", device), _pool("nvfp4", device)
    lkv = src.layers[1]
    lkv.k_sf.view(torch.uint8)[7, 3] = 0x7F  # page 7, token slot 3: the prompt's 4 * 2 + 3 + 1 = 12th token
    parts = [lkv.k, lkv.k_sf, lkv.v, lkv.v_sf]
    ok = PageImporter(dst)
    ok.copy_from(parts, 1, [5, 6, 7], [0, 1, 2], 11)  # 11 tokens: slot 3 of the third page is not the prompt's
    ok.finish()
    bad = PageImporter(dst)
    bad.copy_from(parts, 1, [5, 6, 7], [0, 1, 2], 12)
    with pytest.raises(ValueError, match="NaN"):
        bad.finish()
    assert PARTS == ("k", "k_sf", "v", "v_sf")


@pytest.mark.parametrize("device", DEVICES)
def test_an_inf_bf16_value_in_a_message_fails_the_write(device):
    src, dst = _pool("bf16", device), _pool("bf16", device)
    src.layers[0].v.view(torch.uint8)[9, 2, 1, 6:8] = torch.tensor([0x80, 0x7F], dtype=torch.uint8)  # +inf
    run = decode_page_run(PageExporter(pool_view(src)).messages("r", 0, 0, [8, 9], 2, None)[0])
    ok = PageImporter(dst)
    ok.write(run, [0, 1], 6)  # slot 2 of the second page is token 6: outside a 6-token prompt
    ok.finish()
    bad = PageImporter(dst)
    bad.write(run, [0, 1], 7)
    with pytest.raises(ValueError, match="NaN or inf"):
        bad.finish()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype, part, byte", [("nvfp4", "k_sf", 0x7F), ("nvfp4", "v_sf", 0xFF),
                                                  ("fp8_e4m3", "k", 0xFF), ("fp8_e4m3", "v", 0x7F)])
def test_an_e4m3_nan_in_a_message_fails_the_write_only_inside_the_prompt(device, kv_dtype, part, byte):
    # checked on the pool's device as the message is written (no host scan), reported by finish
    src, dst = _pool(kv_dtype, device), _pool(kv_dtype, device)
    t = getattr(src.layers[1], part).view(torch.uint8)
    t[9, 2].view(-1)[0] = byte  # second page of the run, token slot 2: token 4 + 2 = 6 of the prompt
    run = decode_page_run(PageExporter(pool_view(src)).messages("r", 1, 0, [8, 9], 2, None)[0])
    ok = PageImporter(dst)
    ok.write(run, [0, 1], 6)  # a 6-token prompt ends before that slot
    ok.finish()
    bad = PageImporter(dst)
    bad.write(run, [0, 1], 7)
    with pytest.raises(ValueError, match="NaN or inf"):
        bad.finish()


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kv_dtype", ["nvfp4", "fp8_e4m3"])
@pytest.mark.parametrize("align", [64, 0], ids=["aligned", "protobuf-bytes"])
def test_aligned_and_unaligned_messages_write_the_same_pages_and_checks(device, kv_dtype, align):
    """A message from this service's prefill (parts aligned: on a GPU the whole-message launch) and one of
    protobuf's own bytes (another sender: parts staged one by one) write the same bytes and fail the same NaN."""
    from svc_common.kv_wire import encode_page_run
    from svc_common.page_import import _lies_aligned

    src, dst = _pool(kv_dtype, device), _pool(kv_dtype, device, pages=96)
    pages, targets = [3, 4, 5, 40, 41], [90, 10, 11, 12, 0]
    lkv = src.layers[1]

    def message(bad: bool) -> bytes:
        parts = [[] if t is None else [bytes(t.view(torch.uint8)[pages].cpu().numpy())]
                 for t in (lkv.k, lkv.k_sf, lkv.v, lkv.v_sf)]
        if bad:  # page 3 of the run, token slot 1: the prompt's token 9
            i = 1 if kv_dtype == "nvfp4" else 2  # k_sf, or v's E4M3 values
            raw = bytearray(parts[i][0])
            per_page = len(raw) // len(pages)
            raw[2 * per_page + per_page // 4] = 0x7F
            parts[i] = [bytes(raw)]
        return encode_page_run("r", 1, 0, len(pages), parts, align=align)

    run = decode_page_run(message(False))
    assert _lies_aligned(run, PageImporter(dst).page_bytes) == (align == 64)
    imp = PageImporter(dst)
    imp.write(run, targets, len(pages) * 4)
    imp.finish()
    for a, b in zip(_rows(src, 1, pages), _rows(dst, 1, targets), strict=True):
        assert torch.equal(a, b)
    for num_tokens, fails in ((9, False), (10, True)):
        imp = PageImporter(dst)
        imp.write(decode_page_run(message(True)), targets, num_tokens)
        if fails:
            with pytest.raises(ValueError, match="NaN or inf"):
                imp.finish()
        else:
            imp.finish()


@pytest.mark.parametrize("sizes", [(64, 8, 64, 8), (96, 0, 96, 0)])
def test_a_message_built_in_place_is_the_protobuf_serialization(sizes):
    from nvfp4_serve_proto import prefill_pb2
    from svc_common.kv_wire import encode_page_run, frame_page_run
    from svc_common.page_export import message_from

    g = torch.Generator().manual_seed(3)
    parts = [torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).numpy() if n else None for n in sizes]
    blobs = [b"" if p is None else bytes(p) for p in parts]
    want = prefill_pb2.PrefillMessage(request_id="req-é", pages=prefill_pb2.KVPageRun(
        layer=3, first_page=130, num_pages=2, k=blobs[0], k_scales=blobs[1], v=blobs[2], v_scales=blobs[3]))
    plain = message_from(frame_page_run("req-é", 3, 130, 2, sizes, align=0), parts)
    assert isinstance(plain, bytes) and plain == want.SerializeToString()  # unaligned: protobuf's own bytes
    built = message_from(frame_page_run("req-é", 3, 130, 2, sizes), parts)  # the senders' default: aligned
    assert built == encode_page_run("req-é", 3, 130, 2, [[b] if b else [] for b in blobs])
    parsed = prefill_pb2.PrefillMessage.FromString(built)  # any protobuf client reads the same message
    parsed.pages.ClearField("padding")
    assert parsed == want and len(built) > len(plain)
    run = decode_page_run(built)
    assert [bytes(p) for p in run.parts] == blobs
    assert all(a % 64 == 0 for (a, _), n in zip(run.spans, sizes, strict=True) if n)


def test_several_messages_framed_in_one_call_each_equal_their_own_encoding():
    """``messages_from`` (what an export frames at once): views of one host buffer as sources, messages of
    different page counts (a layer's last message is shorter), nvfp4 parts and fp8's absent scales."""
    from svc_common.kv_wire import encode_page_run, frame_page_run
    from svc_common.page_export import messages_from

    g = torch.Generator().manual_seed(5)
    for page in ((128, 16, 128, 16), (256, 0, 256, 0)):
        host = torch.randint(0, 256, (sum(page) * 7,), generator=g, dtype=torch.uint8)
        frames, payloads, want = [], [], []
        first = 0
        for m in (3, 3, 1):  # pages per message; parts lie part-major in the buffer, as an export's gather
            parts, offset = [], 0
            for b in page:
                parts.append(host[offset + first * b:offset + (first + m) * b] if b else None)
                offset += 7 * b
            frames.append(frame_page_run("r", 2, 40 + first, m, [m * b for b in page]))
            payloads.append(parts)
            want.append(encode_page_run("r", 2, 40 + first, m, [[bytes(p.numpy())] if p is not None else []
                                                              for p in parts]))
            first += m
        got = messages_from(frames, payloads)
        assert all(isinstance(x, bytes) for x in got) and got == want


def test_aligned_framing_puts_every_part_at_a_multiple_of_64_whatever_the_header():
    import os

    from nvfp4_serve_proto import prefill_pb2
    from svc_common.kv_wire import encode_page_run

    rnd = random.Random(5)
    for _ in range(200):  # request ids and run headers of every length; the run's length prefix of 1-4 bytes
        sizes = [rnd.choice([0, 16, 1024, 8192 * rnd.randint(1, 300)]) for _ in range(4)]
        blobs = [os.urandom(n) for n in sizes]
        rid, layer, first = "r" * rnd.randint(0, 130), rnd.randint(0, 99), rnd.randint(0, 1 << 21)
        msg = encode_page_run(rid, layer, first, 7, [[b] if b else [] for b in blobs])
        run = decode_page_run(msg)
        assert (run.request_id, run.layer, run.first_page, run.num_pages) == (rid, layer, first, 7)
        assert [bytes(p) for p in run.parts] == blobs
        assert all(a % 64 == 0 for (a, _), n in zip(run.spans, sizes, strict=True) if n), (sizes, run.spans)
        pages = prefill_pb2.PrefillMessage.FromString(msg).pages
        assert [pages.k, pages.k_scales, pages.v, pages.v_scales] == blobs and set(pages.padding) <= {0}


def test_unaligned_framing_is_byte_for_byte_protobufs_at_every_varint_length():
    """Run lengths and part sizes at each varint boundary (1 to 4 bytes): the framing's own length bookkeeping
    (the run's length prefix settled with its padding) gives exactly protobuf's serialization."""
    import random

    from nvfp4_serve_proto import prefill_pb2
    from svc_common.kv_wire import frame_page_run
    from svc_common.page_export import message_from

    rnd = random.Random(11)
    edges = [1, 100, 127, 128, 129, 16_383, 16_384, 16_385, (1 << 21) - 40, 1 << 21]
    for _ in range(60):
        sizes = [rnd.choice([0, *edges]) for _ in range(4)]
        blobs = [bytes(rnd.getrandbits(8) for _ in range(min(n, 64))) * (n // 64) + bytes(n % 64) for n in sizes]
        rid, layer, first, num = "q" * rnd.randint(0, 200), rnd.randint(0, 200), rnd.randint(0, 1 << 22), rnd.randint(0, 300)
        want = prefill_pb2.PrefillMessage(request_id=rid, pages=prefill_pb2.KVPageRun(
            layer=layer, first_page=first, num_pages=num, k=blobs[0], k_scales=blobs[1], v=blobs[2],
            v_scales=blobs[3])).SerializeToString()
        parts = [torch.frombuffer(bytearray(b), dtype=torch.uint8) if b else None for b in blobs]
        assert message_from(frame_page_run(rid, layer, first, num, sizes, align=0), parts) == want, sizes


_BATCHED_UNDER_INTERPRETER = """
import random, torch
from svc_common.page_import import PageImporter, PageTableCache
from tests.test_kv_copy import _pool, _rows
for kv_dtype in ("nvfp4", "fp8_e4m3", "bf16"):
    src, dst = _pool(kv_dtype, "cpu"), _pool(kv_dtype, "cpu", pages=128)
    rnd = random.Random(4)
    src_pages, dst_pages = rnd.sample(range(64), 12), rnd.sample(range(128), 12)
    parts = [[lkv.k, lkv.k_sf, lkv.v, lkv.v_sf] for lkv in src.layers]
    cache = PageTableCache()  # a receiver's, shared by its pulls
    imp = PageImporter(dst, cache)
    imp._batched = True  # the GPU's one-launch-per-kind path, run by Triton's interpreter on CPU tensors
    imp.copy_from_layers(parts, [0, 1], src_pages, dst_pages, 12 * 4)
    imp.check_written([0, 1], dst_pages, 12 * 4)
    imp.finish()
    assert cache.built == 2  # one table set for the copy, one for the check in place
    for layer in range(2):
        for a, b in zip(_rows(src, layer, src_pages), _rows(dst, layer, dst_pages), strict=True):
            assert torch.equal(a, b), (kv_dtype, layer)
    bad = src.layers[1].k_sf if kv_dtype == "nvfp4" else src.layers[1].v
    bad.view(torch.uint8)[src_pages[2], 3] = 0x7F if kv_dtype != "bf16" else 0
    if kv_dtype == "bf16":  # +inf: exponent all ones in the high byte of a value of slot 3
        bad.view(torch.uint8)[src_pages[2], 3, 0, 1] = 0x7F
        bad.view(torch.uint8)[src_pages[2], 3, 0, 0] = 0x80
    for n, fails in ((11, False), (12, True)):
        imp = PageImporter(dst, cache)  # the next pulls: the same tables, none built again
        imp._batched = True
        imp.copy_from_layers(parts, [0, 1], src_pages[:3], dst_pages[:3], n)
        try:
            imp.finish()
            assert not fails, (kv_dtype, n)
        except ValueError:
            assert fails, (kv_dtype, n)
    assert cache.built == 2, cache.built
print("batched ok")
"""


_STAGED_UNDER_INTERPRETER = """
import random, torch
from svc_common.page_export import PageExporter
from svc_common.page_import import PageImporter
from svc_common.kv_transfer_ipc import pool_view
from svc_common.kv_wire import decode_page_run, encode_page_run
from tests.test_kv_copy import _pool, _rows
for kv_dtype in ("nvfp4", "fp8_e4m3", "bf16"):
    src, dst = _pool(kv_dtype, "cpu"), _pool(kv_dtype, "cpu", pages=128)
    rnd = random.Random(6)
    src_pages, dst_pages = rnd.sample(range(64), 12), rnd.sample(range(128), 12)
    imp = PageImporter(dst)
    imp.use_staged_copy()  # the GPU's whole-message path, run by Triton's interpreter on CPU tensors
    for layer in range(2):
        for msg in PageExporter(pool_view(src)).messages("r", layer, 0, src_pages, 5, None):  # aligned parts
            run = decode_page_run(msg)
            imp.write(run, dst_pages[run.first_page:run.first_page + run.num_pages], run.num_pages * 4)
    imp.finish()
    assert imp.times.writes == 6
    for layer in range(2):
        for a, b in zip(_rows(src, layer, src_pages), _rows(dst, layer, dst_pages), strict=True):
            assert torch.equal(a, b), (kv_dtype, layer)
    lkv = src.layers[1]
    parts = [[] if t is None else [bytes(t.view(torch.uint8)[src_pages[:3]].numpy())]
             for t in (lkv.k, lkv.k_sf, lkv.v, lkv.v_sf)]
    bad = 1 if kv_dtype == "nvfp4" else 2  # a NaN/inf byte in page 1's slot 1: of k_sf, or of v's values
    raw = bytearray(b"".join(parts[bad]))
    per_page = len(raw) // 3
    raw[per_page + per_page // 4 + 1] = 0x7F  # E4M3 NaN; with the next line the high byte of a bf16 +inf
    if kv_dtype == "bf16":
        raw[per_page + per_page // 4] = 0x80
    parts[bad] = [bytes(raw)]
    for num_tokens, fails in ((5, False), (6, True)):  # slot 1 of page 1 is the prompt's token 5
        for align in (64, 0):  # aligned: the staged launch; protobuf's own bytes: part by part
            imp = PageImporter(dst)
            imp.use_staged_copy()
            imp.write(decode_page_run(encode_page_run("r", 1, 0, 3, parts, align=align)), dst_pages[:3], num_tokens)
            try:
                imp.finish()
                assert not fails, (kv_dtype, num_tokens, align)
            except ValueError:
                assert fails, (kv_dtype, num_tokens, align)
print("staged ok")
"""


def test_the_whole_message_write_under_the_triton_interpreter_equals_indexing():
    """``PageImporter.write`` of aligned messages as a GPU runs it (the message staged whole, one launch),
    under Triton's interpreter: bytes equal indexing; a NaN/inf inside the prompt's slots fails the write,
    one slot past it does not, on the staged path and on the part-by-part path of unaligned messages."""
    pytest.importorskip("triton")
    from tests.triton_interpreter import run_interpreted
    res = run_interpreted(_STAGED_UNDER_INTERPRETER)
    assert res.returncode == 0 and "staged ok" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


def test_the_batched_copy_and_check_path_under_the_triton_interpreter_equals_indexing():
    """``copy_from_layers`` / ``check_written`` as a GPU runs them (tables, one launch per kind of part), under
    Triton's interpreter: bytes equal indexing, a NaN/inf in the prompt's slots fails, one past it does not;
    the tables are built once for the pulls sharing a cache."""
    pytest.importorskip("triton")
    from tests.triton_interpreter import run_interpreted
    res = run_interpreted(_BATCHED_UNDER_INTERPRETER)
    assert res.returncode == 0 and "batched ok" in res.stdout, res.stdout[-2000:] + res.stderr[-4000:]


def test_the_page_table_cache_builds_each_key_once_and_drops_the_least_recently_used():
    from svc_common.page_import import PageTableCache
    cache, made = PageTableCache(capacity=2), []

    def build(name):
        return lambda: made.append(name) or name

    assert [cache.get(("a",), build("a")), cache.get(("b",), build("b")), cache.get(("a",), build("a2"))] == \
        ["a", "b", "a"]
    cache.get(("c",), build("c"))  # full: "b" is the least recently used
    assert cache.get(("b",), build("b2")) == "b2" and cache.get(("a",), build("a3")) == "a3"
    assert made == ["a", "b", "c", "b2", "a3"] and cache.built == 5
    with pytest.raises(ValueError, match=">= 1"):
        PageTableCache(capacity=0)
