"""Pages stream while the prompt runs, and a transfer cancelled at any stage frees every page on both sides.

A prefill and a decode service run in this process (tests/pd_harness.py: real engines and gRPC servers);
``ChunkGate`` holds the prefill engine right before a chosen chunk of the chunked prefill, so "before the
last chunk is computed" is a fact the test controls, not a timing guess.
"""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from nvfp4_serve_proto import common_pb2, decode_pb2_grpc, prefill_pb2, prefill_pb2_grpc
from svc_common.page_import import PageImporter
from tests.pd_harness import ChunkGate, services

PAGE, CHUNK = 4, 8  # a 40-token prompt runs as 5 chunks of 2 pages each


def prompt(n: int, offset: int = 5) -> list[int]:
    return [(offset + 7 * i) % 400 + 3 for i in range(n)]


def reference(model_dir: str, ids: list[int], max_tokens: int) -> list[int]:
    from engine.sampling import SamplingParams
    from tests.pd_harness import engine

    eng = engine(model_dir, page_size=PAGE, chunk_size=CHUNK)
    return eng.generate([ids], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))[0].token_ids


def test_a_page_message_leaves_before_the_prompts_last_chunk_is_computed(tiny_model_dir):
    async def scenario():
        async with services(tiny_model_dir, page_size=PAGE, chunk_size=CHUNK) as s:
            gate = ChunkGate(s.prefill.engine.runner, index=4)  # the last of the 5 chunks waits for us
            req = prefill_pb2.PrefillRequest(request_id="o", token_ids=prompt(40),
                                             sampling=common_pb2.SamplingParams(temperature=0, max_tokens=1))
            async with grpc.aio.insecure_channel(s.prefill_address) as ch:
                stream = prefill_pb2_grpc.PrefillStub(ch).Prefill(req).__aiter__()
                early = []
                while not any(m.HasField("pages") for m in early):  # no page before the end: times out here
                    early.append(await asyncio.wait_for(stream.__anext__(), 30))
                before_release = not gate.released.is_set() and gate.calls <= 4
                gate.release()
                rest = [m async for m in stream]
            return early, rest, before_release

    early, rest, before_release = asyncio.run(scenario())
    assert before_release
    assert early[0].WhichOneof("payload") == "header" and early[0].header.num_pages == 10
    first = early[-1].pages
    assert (first.layer, first.first_page, first.num_pages) == (0, 0, 2)  # chunk 0's two pages, layer 0 first
    msgs = early + rest
    assert msgs[-1].WhichOneof("payload") == "done"
    covered = [(m.pages.layer, m.pages.first_page + i) for m in msgs if m.HasField("pages")
               for i in range(m.pages.num_pages)]
    assert sorted(covered) == [(layer, p) for layer in range(2) for p in range(10)]  # every page once


class _WriteGate:
    """Blocks the decode's ``n``-th page write (on its copy thread) until released."""

    def __init__(self, monkeypatch, n: int):
        self.reached, self.released, self.calls = threading.Event(), threading.Event(), 0
        inner = PageImporter.write

        def write(importer, *args, **kw):
            self.calls += 1
            if self.calls == n:
                self.reached.set()
                self.released.wait(60)
            return inner(importer, *args, **kw)

        monkeypatch.setattr(PageImporter, "write", write)

    def release(self) -> None:
        self.released.set()


STAGES = {
    "queued at the prefill, before the header": ("chunk", 0),
    "mid-stream, two chunks sent": ("chunk", 2),
    "every page but the last chunk's sent": ("chunk", 4),
    "while the decode writes a page run": ("write", 3),
}


@pytest.mark.parametrize("stage", list(STAGES))
def test_a_transfer_cancelled_at_every_stage_frees_every_page_on_both_sides(tiny_model_dir, monkeypatch, stage):
    kind, n = STAGES[stage]

    async def scenario():
        async with services(tiny_model_dir, page_size=PAGE, chunk_size=CHUNK) as s:
            gate = ChunkGate(s.prefill.engine.runner, n) if kind == "chunk" else _WriteGate(monkeypatch, n)
            async with grpc.aio.insecure_channel(s.decode_address) as ch:
                call = decode_pb2_grpc.DecodeStub(ch).Generate(s.request("c", prompt(40), 4))
                reading = asyncio.ensure_future(call.read())
                assert await asyncio.to_thread(gate.reached.wait, 30), "the stage was never reached"
                call.cancel()
                await asyncio.gather(reading, return_exceptions=True)
                gate.release()
            load, rep = await s.idle()
            later = await s.generate("after", prompt(24, offset=9), 4)
            return load, rep, later

    load, rep, later = asyncio.run(scenario())
    assert load.pool_pages_in_use == 0
    assert rep.ok and rep.num_in_use == 0 and rep.num_cached == 0  # nothing of the cancelled prompt cached
    assert later == reference(tiny_model_dir, prompt(24, offset=9), 4)  # the services keep serving


def test_the_prefills_compute_time_excludes_the_wait_behind_earlier_pages(tiny_model_dir):
    """``nvfp4_prefill_ttft_seconds`` is when the engine finished the prompt, not when the stream, still sending
    earlier chunks' pages (each held 1.5 s here), got to its end: that is 2 x 1.5 s at least (chunk 0's two
    page messages go out before the last chunk's output is handled)."""
    import re
    import time

    async def scenario():
        async with services(tiny_model_dir, page_size=PAGE, chunk_size=CHUNK) as s:
            s.prefill.debug_delay = 1.5  # before each page message (tests only)
            t0 = time.perf_counter()
            await s.generate("t", prompt(40), max_tokens=2)
            elapsed = time.perf_counter() - t0
            text = s.prefill.metrics.text()
        return elapsed, float(re.search(r"^nvfp4_prefill_ttft_seconds_sum (\S+)$", text, re.MULTILINE).group(1))

    elapsed, computed = asyncio.run(scenario())
    assert elapsed >= 5.5  # chunk 0's two page messages, then the rest of both layers: 4 x 1.5 s at least
    assert computed < 2.5  # five chunks of a 2-layer tiny model (0.2-0.9 s on 2 busy cores), not 3 s or more


def test_a_streams_exports_start_with_one_message_and_double_up_to_the_export_size():
    from prefill_svc.page_sender import export_units

    units = export_units(range(2), num_pages=2048, per_message=227, max_messages=8)
    assert [m for _, _, m in units[:4]] == [227, 454, 908, 459]  # 1, 2, 4 messages, then the layer's rest
    assert units[4:] == [(1, 0, 1816), (1, 1816, 232)]  # 8 messages at most
    for layer in range(2):  # every page of every layer once, in order
        runs = [(i, m) for lay, i, m in units if lay == layer]
        assert [i for i, _ in runs] == [sum(m for _, m in runs[:k]) for k in range(len(runs))]
        assert sum(m for _, m in runs) == 2048
    assert export_units(range(1), 3, 5, 8) == [(0, 0, 3)] and export_units(range(3), 0, 5, 8) == []
    assert [lay for lay, _, _ in export_units(range(2, 4), 6, 5, 8)] == [2, 2, 3]  # a run of some layers


def test_a_sender_keeps_its_configured_number_of_exports_in_flight():
    """--kv-exports-ahead: a transfer's exports run that many at once on worker threads (each blocks for 30 ms
    here), every message still in send order; 0 picks the sender's measured default."""
    import time

    from engine.config import EngineConfig
    from engine.kv_pool import KVPool
    from prefill_svc.config import PrefillConfig
    from prefill_svc.page_sender import PageSender, exports_ahead
    from svc_common.kv_transfer_ipc import pool_view
    from svc_common.kv_wire import decode_page_run
    from svc_common.page_export import PageExporter

    class Slow(PageExporter):  # the real exporter of a host pool, each export held 30 ms and counted
        running = peak = 0
        lock = threading.Lock()

        def messages(self, *args, **kwargs):
            with self.lock:
                Slow.running += 1
                Slow.peak = max(Slow.peak, Slow.running)
            time.sleep(0.03)
            try:
                return super().messages(*args, **kwargs)
            finally:
                with self.lock:
                    Slow.running -= 1

    pool = KVPool("nvfp4", 2, 40, 4, 2, 64)
    for ahead in (1, 4):
        Slow.peak = 0
        sender = PageSender(Slow(pool_view(pool)), "r", 1, 2, exports_ahead=ahead)

        async def drain(s: PageSender) -> list[bytes]:
            return [m async for m in s.pages(list(range(32)), 0, None)]

        msgs = asyncio.run(drain(sender))
        order = [(run.layer, run.first_page) for run in map(decode_page_run, msgs)]
        assert order == sorted(order) and len(order) == 2 * 32  # one page per message, layer by layer
        assert Slow.peak == ahead
    assert (exports_ahead(0, True), exports_ahead(0, False), exports_ahead(5, False)) == (3, 2, 5)
    with pytest.raises(ValueError, match="--kv-exports-ahead must be in 0..16"):
        PrefillConfig(engine=EngineConfig(model_dir="m"), kv_exports_ahead=17)
