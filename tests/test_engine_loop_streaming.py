"""The engine loop streams a step's tokens while the next decode step runs, in order and without losing any,
and logs where its time goes (engine/engine_loop.py, engine/step_stats.py)."""

from __future__ import annotations

import logging
import sys
import threading

import pytest

from engine.outcome import FinishReason
from engine.step_stats import StepStats


def _engine(model_dir: str, overlap: bool):
    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import Engine

    # bf16 pool: a cache hit then gives the same numbers as a fresh prompt (an NVFP4 prefix would round)
    return Engine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32",
                               cache=CacheConfig(page_size=4, max_total_tokens=512, kv_dtype="bf16"),
                               scheduler=SchedulerConfig(disable_overlap_schedule=not overlap)))


@pytest.fixture(params=[True, False], ids=["overlap", "no-overlap"])
def engine(tiny_model_dir, request):
    return _engine(tiny_model_dir, request.param)


@pytest.fixture()
def sync_engine(tiny_model_dir):
    """Each decode step's tokens read before the next is launched (--disable-overlap-schedule)."""
    return _engine(tiny_model_dir, overlap=False)


def _run(loop, prompts: list[list[int]], max_tokens: int, events: list | None = None):
    from engine.request import Request
    from engine.sampling import SamplingParams

    got: dict[str, list] = {}
    done = threading.Semaphore(0)

    def callback(rid):
        def on_output(out):
            got[rid].append(out)
            if events is not None:
                events.append(("out", rid, tuple(out.new_token_ids)))
            if out.finish_reason:
                done.release()
        return on_output

    for i, p in enumerate(prompts):
        rid = f"r{i}"
        got[rid] = []
        loop.submit(Request(rid, p, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)),
                    callback(rid))
    for _ in prompts:
        assert done.acquire(timeout=60), "a request never finished"
    return got


def test_streamed_tokens_are_complete_in_order_and_equal_offline_generation(engine):
    from engine.engine_loop import EngineLoop
    from engine.sampling import SamplingParams

    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [3] * 9]
    want = [o.token_ids for o in engine.generate(prompts, SamplingParams(temperature=0, max_tokens=7,
                                                                           ignore_eos=True))]
    loop = EngineLoop(engine).start()
    try:
        got = _run(loop, prompts, 7)
    finally:
        loop.stop()
    for i, w in enumerate(want):
        outs = got[f"r{i}"]
        assert [t for o in outs for t in o.new_token_ids] == w
        assert [o.finish_reason for o in outs] == [None] * (len(outs) - 1) + [FinishReason.LENGTH]


def _trace_decode_steps(runner, events: list) -> None:
    """Record each decode step's launch (whether its input ids were read on the device) and read (its tokens)."""
    launch, finish = runner.launch_decode, runner.finish_decode

    def traced_launch(reqs, carry=None):
        events.append(("launch", carry is not None and all(r >= 0 for r in carry.rows)))
        return launch(reqs, carry)

    def traced_finish(reqs, sampled, keep=None):
        tokens = finish(reqs, sampled, keep)
        events.append(("read", tuple(tokens)))
        return tokens

    runner.launch_decode, runner.finish_decode = traced_launch, traced_finish


def _steps_of_one_request(engine) -> tuple[list, list[int], list[int], list]:
    """One request of 5 tokens through a started loop: every event in order, the indexes of the decode steps'
    launches and reads, and the tokens handed out."""
    from engine.engine_loop import EngineLoop

    events: list = []
    _trace_decode_steps(engine.runner, events)
    loop = EngineLoop(engine).start()
    try:
        _run(loop, [[5, 6, 7, 8, 9]], 5, events)
    finally:
        loop.stop()
    launches = [i for i, e in enumerate(events) if e[0] == "launch"]
    reads = [i for i, e in enumerate(events) if e[0] == "read"]
    outs = [e[2] for e in events if e[0] == "out"]
    assert outs[1:] == [events[i][1] for i in reads]  # the first token comes from the extend
    return events, launches, reads, outs


def test_without_overlap_a_steps_tokens_are_handed_out_while_the_next_decode_step_is_in_flight(sync_engine):
    events, launches, reads, _ = _steps_of_one_request(sync_engine)
    # every decode step's tokens are read before the next step is launched (its input ids come from the host),
    # and go out inside the next step, after its launch and before its own tokens are back; the last step's
    # tokens go out once idle
    assert [events[i][1] for i in launches] == [False] * 4 and len(reads) == 4
    for k in range(1, 4):
        out_prev = events.index(("out", "r0", events[reads[k - 1]][1]))
        assert reads[k - 1] < launches[k] < out_prev < reads[k], events
    assert events[-1] == ("out", "r0", events[reads[-1]][1])


def test_with_overlap_a_step_is_launched_before_the_last_steps_tokens_are_read(tiny_model_dir):
    """Overlap scheduling: decode step k is queued (its input ids read on the device) before step k-1's tokens
    reach the host, and those go out at once, before step k is read. No step is wasted on a length finish."""
    events, launches, reads, _ = _steps_of_one_request(_engine(tiny_model_dir, overlap=True))
    # the first decode step reads the extend's token from the host, every later one the last step's on the device
    assert [events[i][1] for i in launches] == [False, True, True, True] and len(reads) == 4
    for k in range(3):
        out_k = events.index(("out", "r0", events[reads[k]][1]))
        assert launches[k + 1] < reads[k] < out_k < reads[k + 1], events


def test_tokens_already_produced_go_out_before_an_extend_batch_runs(engine):
    """An extend batch can take 100+ ms on a GPU: the running requests' last tokens must not wait for it."""
    from engine.engine_loop import EngineLoop
    from engine.request import Request
    from engine.sampling import SamplingParams

    events: list = []
    runner = engine.runner
    finish, extend = runner.finish_decode, runner.extend

    def traced_finish(reqs, sampled, keep=None):
        tokens = finish(reqs, sampled, keep)
        events.append(("produced", sum(keep) if keep is not None else len(tokens)))
        return tokens

    def traced_extend(reqs, lens, mask):
        events.append(("extend",))
        tokens = extend(reqs, lens, mask)
        events.append(("produced", sum(t is not None for t in tokens)))
        return tokens

    runner.finish_decode, runner.extend = traced_finish, traced_extend
    loop = EngineLoop(engine).start()
    first, done = threading.Event(), threading.Semaphore(0)

    def on_output(out):
        events.append(("out",))
        first.set()
        if out.finish_reason:
            done.release()

    sp = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    try:
        loop.submit(Request("a", [5, 6, 7, 8, 9], sp), on_output)
        assert first.wait(30)
        loop.submit(Request("b", list(range(1, 31)), sp), on_output)  # extends while "a" decodes
        assert done.acquire(timeout=60) and done.acquire(timeout=60)
    finally:
        loop.stop()
    extends = [i for i, e in enumerate(events) if e[0] == "extend"]
    assert len(extends) == 2
    i = extends[1]
    produced = sum(e[1] for e in events[:i] if e[0] == "produced")
    delivered = sum(1 for e in events[:i] if e[0] == "out")
    assert produced > 1 and delivered == produced  # every token of "a" so far is out before "b"'s extend


def test_the_loop_logs_decode_throughput_and_host_time(engine, caplog):
    from engine.engine_loop import EngineLoop

    loop = EngineLoop(engine, stats_interval_s=1e-3).start()
    with caplog.at_level(logging.INFO, logger="engine.engine_loop"):
        try:
            _run(loop, [[5, 6, 7, 8, 9], [1, 2, 3]], 12)
        finally:
            loop.stop()
    lines = [r.getMessage() for r in caplog.records if "decode tok/s" in r.getMessage()]
    assert lines and "device wait" in lines[0] and "host" in lines[0]


def test_step_stats_summarise_one_interval_at_a_time():
    stats = StepStats(10.0, start=100.0, device_wait_total=5.0)
    stats.add(0.020, 8)  # a decode step of 8
    stats.add(0.030, 0)  # an extend-only step
    stats.add(0.010, 8)
    assert stats.poll(105.0, 5.02) is None  # the interval has not ended
    s = stats.poll(110.0, 5.04)
    assert (s.iterations, s.decode_steps, s.decode_tokens) == (3, 2, 16)
    assert s.seconds == pytest.approx(10.0) and s.device_wait_s == pytest.approx(0.04)
    assert s.host_ms_per_step == pytest.approx(1e3 * (0.060 - 0.04) / 3)
    assert s.line().startswith("engine: 2 decode tok/s, 0.2 decode steps/s, mean batch 8.0;")
    assert stats.poll(121.0, 6.0) is None  # a new interval in which nothing ran
    with pytest.raises(ValueError):
        StepStats(0, start=0.0)


def test_services_shorten_the_gil_switch_interval():
    from engine.engine_loop import ENGINE_SWITCH_INTERVAL_S, favour_engine_thread

    before = sys.getswitchinterval()
    try:
        favour_engine_thread()
        assert sys.getswitchinterval() == pytest.approx(ENGINE_SWITCH_INTERVAL_S)
    finally:
        sys.setswitchinterval(before)
