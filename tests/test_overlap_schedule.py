"""Overlap scheduling (engine/scheduler.py, engine/in_flight.py): decode step k is launched before step k-1's tokens
are read, its input ids taken on the device. It must change nothing a request sees (tokens, finish reasons,
logprobs), run requests whose sampling reads their outputs on the host without overlap, and keep every page
accounted for: a request that ends while a step writing its slot is in flight gives its pages back only once that
step is read."""

from __future__ import annotations

import pytest
import torch

from engine.carried_tokens import CarriedTokens
from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.outcome import Failure, FailureKind, FinishReason, StepFailed
from engine.request import Status
from engine.sampling import SamplingParams
from tests.test_engine_isolation import run

GREEDY = SamplingParams(temperature=0, max_tokens=9, ignore_eos=True)


def make_engine(model_dir: str, overlap: bool, kv_dtype: str = "bf16", max_total_tokens: int = 2048,
                **sched) -> Engine:
    return Engine(EngineConfig(
        model_dir=model_dir, device="cpu", dtype="float32",
        cache=CacheConfig(kv_dtype=kv_dtype, page_size=4, max_total_tokens=max_total_tokens),
        scheduler=SchedulerConfig(chunk_size=32, disable_overlap_schedule=not overlap, **sched)))


def prompt(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 500, (n,), generator=g).tolist()


def outcome(outs) -> list[tuple]:
    return [(o.token_ids, o.finish_reason) for o in outs]


def run_steps(eng: Engine, outs: dict, steps: int | None = None) -> None:
    run(eng, steps, outs)


@pytest.mark.parametrize("kv_dtype", ["bf16", "nvfp4"])
def test_overlap_changes_no_token_finish_reason_or_logprob(tiny_model_dir, kv_dtype):
    free = make_engine(tiny_model_dir, False, kv_dtype).generate([prompt(17, 1)], GREEDY)[0].token_ids
    stop_at = free[4]  # a stop token seen one step late under overlap: the row launched meanwhile is dropped
    prompts = [prompt(n, seed=10 + n) for n in (17, 5, 30, 9, 23, 12)] + [prompt(17, 1)]
    params = [
        GREEDY,
        SamplingParams(temperature=0, max_tokens=1, ignore_eos=True),  # ends with the extend's token
        SamplingParams(temperature=0, max_tokens=2, ignore_eos=True),  # ends by length one step after
        SamplingParams(temperature=1.0, top_p=0.9, seed=7, max_tokens=11, ignore_eos=True),  # seeded
        SamplingParams(temperature=0, max_tokens=8, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.8, top_k=20, seed=3, max_tokens=10, min_tokens=6),  # min_tokens, EOS allowed
        SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,), ignore_eos=True),
    ]
    sync, overlap = make_engine(tiny_model_dir, False, kv_dtype), make_engine(tiny_model_dir, True, kv_dtype)
    want, got = sync.generate(prompts, params), overlap.generate(prompts, params)
    assert outcome(got) == outcome(want)
    assert got[-1].finish_reason is FinishReason.STOP and got[-1].token_ids[-1] == stop_at
    assert overlap.check_integrity().num_in_use == 0 and sync.check_integrity().num_in_use == 0
    # one decode step per token each way: the rows dropped after the stop token are not counted
    assert overlap.scheduler.num_decode_tokens == sync.scheduler.num_decode_tokens


def test_the_context_length_ends_a_request_at_the_same_token_under_overlap(tiny_model_dir):
    sp = SamplingParams(temperature=0, max_tokens=50, ignore_eos=True)
    outs = []
    for overlap in (False, True):
        eng = Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32", context_length=26,
                                  cache=CacheConfig(kv_dtype="bf16", page_size=4, max_total_tokens=512),
                                  scheduler=SchedulerConfig(disable_overlap_schedule=not overlap)))
        outs.append(outcome(eng.generate([prompt(17, 2), prompt(9, 3)], sp)))
        assert eng.check_integrity().num_in_use == 0
    assert outs[0] == outs[1]
    assert [len(t) for t, _ in outs[1]] == [26 - 17, 26 - 9] and {r for _, r in outs[1]} == {FinishReason.LENGTH}


def test_logprobs_arrive_with_their_tokens_under_overlap(tiny_model_dir):
    sp = SamplingParams(temperature=0, max_tokens=7, logprobs=2, ignore_eos=True)
    got: dict[str, dict] = {}
    for overlap in (False, True):
        eng = make_engine(tiny_model_dir, overlap)
        for i, p in enumerate([prompt(13, 3), prompt(6, 4)]):
            eng.scheduler.submit(eng.new_request(p, sp, rid=f"r{i}"))
        outs: dict = {}
        run_steps(eng, outs)
        got[overlap] = {rid: [(o.new_token_ids, o.logprobs) for o in v] for rid, v in outs.items()}
        for v in outs.values():
            assert all(o.logprobs is not None and [lp.token_id for lp in o.logprobs] == o.new_token_ids for o in v)
    assert got[True] == got[False]


def _count_carried(eng: Engine) -> list[bool]:
    """Whether each decode step launched took an input id on the device."""
    launch, carried = eng.runner.launch_decode, []

    def traced(reqs, carry=None):
        carried.append(carry is not None and any(r >= 0 for r in carry.rows))
        return launch(reqs, carry)

    eng.runner.launch_decode = traced
    return carried


@pytest.mark.parametrize("kv_dtype", ["bf16", "nvfp4"])
def test_penalties_count_the_token_in_flight_on_the_device(tiny_model_dir, kv_dtype):
    """Repetition, frequency and presence penalties see every output token, the one still in flight included:
    the tokens equal those of steps read one by one, and the steps still overlap."""
    strong = SamplingParams(temperature=0, max_tokens=12, frequency_penalty=2.0, presence_penalty=2.0,
                            repetition_penalty=2.0, ignore_eos=True)
    prompts = [prompt(8, 6), prompt(11, 5), prompt(14, 7)]
    params = [strong, GREEDY, SamplingParams(temperature=0.9, seed=11, max_tokens=10, presence_penalty=2.0,
                                             frequency_penalty=1.0, ignore_eos=True)]
    want = make_engine(tiny_model_dir, False, kv_dtype).generate(prompts, params)
    plain = make_engine(tiny_model_dir, False, kv_dtype).generate(prompts[:1], [GREEDY])[0].token_ids
    assert want[0].token_ids != plain[:len(want[0].token_ids)]  # the penalties are at work on this prompt
    eng = make_engine(tiny_model_dir, True, kv_dtype)
    carried = _count_carried(eng)
    assert outcome(eng.generate(prompts, params)) == outcome(want)
    assert sum(carried) >= 8


def test_a_late_sampling_that_fails_ends_only_its_request(tiny_model_dir):
    """The sampling of a grammar batch fails after its forward was queued (here: the matcher breaks on its third
    mask): every request's step runs again alone, the broken one ends with an error, the others get the tokens
    they would have had, and no page is lost."""
    pytest.importorskip("xgrammar")
    from engine.grammar import GrammarCompiler

    want = make_engine(tiny_model_dir, False).generate([prompt(12, 3)], GREEDY)[0].token_ids
    eng = make_engine(tiny_model_dir, True)
    g = eng.new_request(prompt(9, 2), SamplingParams(temperature=0, max_tokens=14), rid="g")
    g.grammar = GrammarCompiler(tiny_model_dir, eng.model_config.vocab_size, eng.eos_token_ids).compile(
        "regex", "abcdefghijkl")
    allowed, calls = g.grammar.allowed, [0]

    def breaks_on_the_third():
        calls[0] += 1
        if calls[0] >= 3:
            raise RuntimeError("matcher broke")
        return allowed()

    g.grammar.allowed = breaks_on_the_third
    eng.scheduler.submit(eng.new_request(prompt(12, 3), GREEDY, rid="o"))
    eng.scheduler.submit(g)
    outs: dict = {}
    run_steps(eng, outs)
    assert [t for o in outs["o"] for t in o.new_token_ids] == want
    assert outs["g"][-1].finish_reason is FinishReason.ABORT and "matcher broke" in outs["g"][-1].failure.message
    assert eng.check_integrity().num_in_use == 0


def test_a_pending_token_is_penalised_as_if_it_were_in_the_output_ids():
    from engine.sampling import RowTokens, apply_controls

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=g)
    params = [SamplingParams(frequency_penalty=1.2, presence_penalty=0.5, repetition_penalty=1.7),
              SamplingParams(repetition_penalty=1.4), SamplingParams()]
    outs = [[4, 9, 4], [7], [1, 2]]
    pending = torch.tensor([9, -1, 3])  # row 1 has none; row 2 has no penalties
    got = apply_controls(logits, params, [RowTokens([1, 2], o) for o in outs], pending=pending)
    with_it = [o + [int(t)] if t >= 0 else o for o, t in zip(outs, pending)]
    want = apply_controls(logits, params, [RowTokens([1, 2], o) for o in with_it])
    assert torch.equal(got, want)
    assert not torch.equal(got, apply_controls(logits, params, [RowTokens([1, 2], o) for o in outs]))


def test_a_grammar_request_is_sampled_once_the_last_step_is_read(tiny_model_dir):
    """A grammar's matcher takes each token on the host: a batch holding one queues its forward (input ids on the
    device), reads the step before it, and only then samples, under the grammar; the tokens are those of a run
    without overlap, and a stop read meanwhile drops that row unconstrained."""
    pytest.importorskip("xgrammar")
    from engine.grammar import GrammarCompiler

    outs, order = [], []
    for overlap in (False, True):
        e = make_engine(tiny_model_dir, overlap)
        if overlap:
            forward, read, sample = e.runner.decode_logits, e.runner.finish_decode, e.runner.sample_decode

            def traced_forward(reqs, use_graphs=True, carry=None, forward=forward):
                order.append(("forward", carry is not None and any(r >= 0 for r in carry.rows)))
                return forward(reqs, use_graphs, carry)

            def traced_read(*args, read=read, **kw):
                order.append(("read",))
                return read(*args, **kw)

            def traced_sample(*args, sample=sample, **kw):
                order.append(("sample",))
                return sample(*args, **kw)

            e.runner.decode_logits, e.runner.finish_decode = traced_forward, traced_read
            e.runner.sample_decode = traced_sample
        g = e.new_request(prompt(9, 2), SamplingParams(temperature=0, max_tokens=14), rid="g")
        g.grammar = GrammarCompiler(tiny_model_dir, e.model_config.vocab_size, e.eos_token_ids).compile(
            "regex", "abcdefghijkl")
        for r in (g, e.new_request(prompt(12, 3), GREEDY, rid="o")):
            e.scheduler.submit(r)
        got: dict = {}
        run_steps(e, got)
        outs.append({rid: [t for o in v for t in o.new_token_ids] for rid, v in got.items()})
        assert e.check_integrity().num_in_use == 0
    assert outs[0] == outs[1] and len(outs[1]["g"]) >= 4  # the grammar's string, a few tokens long, then EOS
    # with "g" in the batch: forward (carried ids), read of the step before, then the sampling, every step
    steps = [i for i, ev in enumerate(order) if ev == ("forward", True)]
    late = [i for i in steps if i + 2 < len(order) and order[i + 1] == ("read",) and order[i + 2] == ("sample",)]
    assert len(late) >= len(outs[1]["g"]) - 2, order


def test_an_abort_while_its_step_is_in_flight_frees_its_pages_once_the_step_is_read(tiny_model_dir):
    ref = make_engine(tiny_model_dir, True).generate([prompt(21, 7)], GREEDY)[0]
    eng = make_engine(tiny_model_dir, True)
    sch = eng.scheduler
    keep, gone = eng.new_request(prompt(21, 7), GREEDY, rid="keep"), eng.new_request(prompt(14, 8), GREEDY, rid="gone")
    sch.submit(keep)
    sch.submit(gone)
    outs: dict = {}
    run_steps(eng, outs, steps=3)
    assert sch.flights.step is not None and gone.status is Status.RUNNING
    pages = list(gone.page_ids)
    free_before = eng.allocator.num_free
    assert sch.abort("gone") is gone and gone.status is Status.FINISHED
    # the step in flight still writes its slot: nothing of it went back yet, and the pool adds up
    assert gone.page_ids == pages and eng.allocator.num_free == free_before
    sch.check_integrity()
    run_steps(eng, outs, steps=1)
    assert not gone.page_ids and "gone" not in [o.rid for o in eng.scheduler.running]
    sch.check_integrity()
    run_steps(eng, outs)
    assert [t for o in outs["keep"] for t in o.new_token_ids] == ref.token_ids
    assert all(not o.finish_reason for o in outs["gone"])  # no token of it after the abort
    assert eng.check_integrity().num_in_use == 0


def test_a_step_that_fails_to_read_loses_no_page(tiny_model_dir):
    """Reading a step raises (the engine loop then aborts every request, as ``EngineLoop._abort_all`` does): the
    pages of a request aborted while that step was in flight still go back, and so do everyone else's."""
    from engine.engine_loop import EngineLoop

    eng = make_engine(tiny_model_dir, True)
    sch = eng.scheduler
    for i, n in enumerate((13, 9)):
        sch.submit(eng.new_request(prompt(n, 30 + i), GREEDY, rid=f"r{i}"))
    run_steps(eng, {}, steps=3)
    assert sch.flights.step is not None
    sch.abort("r0")  # its pages wait for the step in flight

    def broken(*args, **kw):
        raise RuntimeError("the device went away")

    eng.runner.finish_decode = broken
    with pytest.raises(StepFailed) as failed:
        sch.step()
    assert "went away" in str(failed.value.__cause__)
    outs = EngineLoop(eng)._abort_all(Failure(FailureKind.INTERNAL, "engine error"))
    assert [o.rid for o in outs] == ["r1"] and not sch.has_work
    assert eng.check_integrity().num_in_use == 0


def test_pool_pressure_retracts_under_overlap_without_leaking(tiny_model_dir):
    # 24 pages of 4 tokens: four 20-token prompts growing by 16 cannot all stay; the retracted request's
    # in-flight token is read before it gives its pages back
    prompts = [prompt(20, seed=20 + i) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    eng = make_engine(tiny_model_dir, True, max_total_tokens=96, decode_reserve_tokens=0)
    outs = eng.generate(prompts, sp)
    assert eng.scheduler.num_retractions > 0
    solo = [make_engine(tiny_model_dir, False).generate([p], sp)[0].token_ids for p in prompts]
    assert [o.token_ids for o in outs] == solo
    assert eng.check_integrity().num_in_use == 0


def test_a_stop_token_read_late_caches_the_pages_the_dropped_row_completed(tiny_model_dir):
    """The step launched before the stop token is read writes that token's K/V: the finished request's pages
    hold its whole sequence, which a later prompt then finds cached (and which decodes as a fresh run would)."""
    p = prompt(15, 9)
    free = make_engine(tiny_model_dir, False).generate([p], GREEDY)[0].token_ids
    sp = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(free[4],), ignore_eos=True)
    eng = make_engine(tiny_model_dir, True)
    first = eng.generate([p], sp)[0]
    assert first.token_ids == free[:5]
    follow = p + first.token_ids + prompt(6, 10)
    again = eng.generate([follow], GREEDY)[0]
    assert again.num_cached_tokens == (len(p) + 5) // 4 * 4
    assert again.token_ids == make_engine(tiny_model_dir, False).generate([follow], GREEDY)[0].token_ids
    assert eng.check_integrity().num_in_use == 0


def test_a_flush_right_after_a_late_stop_settles_the_step_in_flight_first(tiny_model_dir):
    """The stop token's request ended while the step after it was in flight: its pages are still held there. A
    cache flush at that moment (a command between steps) first waits for that step, so it frees them too."""
    from engine.engine_loop import EngineLoop

    p = prompt(15, 9)
    free = make_engine(tiny_model_dir, False).generate([p], GREEDY)[0].token_ids
    eng = make_engine(tiny_model_dir, True)
    req = eng.new_request(p, SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(free[4],),
                                            ignore_eos=True), rid="s")
    eng.scheduler.submit(req)
    outs: dict = {}
    while not outs.get("s") or not outs["s"][-1].finish_reason:
        run_steps(eng, outs, steps=1)
    flights = eng.scheduler.flights
    assert flights.step is not None and flights.ending() == [req] and req.page_ids
    loop = EngineLoop(eng, check_integrity_when_idle=False)  # not started: run its command inline
    fut = loop.flush_cache()
    loop._drain()
    freed, idle = fut.result()
    assert idle and freed > 0 and flights.step is None and not req.page_ids
    assert eng.check_integrity().num_cached == 0


def test_carried_rows_must_name_a_row_of_the_previous_step():
    src = torch.tensor([5, 6, 7])
    with pytest.raises(ValueError, match="carried rows"):
        CarriedTokens(src, [0, 3])
    ids = torch.tensor([1, 2, 3, 4])
    CarriedTokens(src, [2, -1, 0, -1]).fill(ids, torch.tensor([2, -1, 0, -1]))
    assert ids.tolist() == [7, 2, 5, 4]


def test_the_flag_turns_overlap_off(tiny_model_dir):
    import argparse

    from svc_common.engine_args import add_engine_args, engine_args_to_argv, engine_config_from_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    on = engine_config_from_args(p.parse_args(["--model", tiny_model_dir]))
    off_args = p.parse_args(["--model", tiny_model_dir, "--disable-overlap-schedule"])
    off = engine_config_from_args(off_args)
    assert (on.scheduler.disable_overlap_schedule, off.scheduler.disable_overlap_schedule) == (False, True)
    # `up` hands it on to the services it starts
    again = engine_config_from_args(p.parse_args(engine_args_to_argv(off_args)))
    assert again.scheduler.disable_overlap_schedule


@pytest.mark.parametrize("overlap", [True, False])
def test_a_step_that_fails_still_hands_out_what_it_produced_before(tiny_model_dir, overlap):
    """A request that ended earlier in a failing step (here: one token, from its prefill) gets its end; the
    others get an error; every callback is done with and no page is lost."""
    import threading
    import time

    from engine.engine_loop import EngineLoop

    eng = make_engine(tiny_model_dir, overlap)
    loop = EngineLoop(eng, check_integrity_when_idle=False).start()
    got: dict[str, list] = {"long": [], "one": []}
    ended = threading.Semaphore(0)

    def cb(rid):
        def on_output(o):
            got[rid].append((o.new_token_ids, o.finish_reason))
            if o.finish_reason:
                ended.release()
        return on_output

    try:
        loop.submit(eng.new_request(prompt(13, 1), SamplingParams(temperature=0, max_tokens=400, ignore_eos=True),
                                    rid="long"), cb("long"))
        deadline = time.monotonic() + 30
        while len(got["long"]) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        one = eng.new_request(prompt(9, 2), SamplingParams(temperature=0, max_tokens=1, ignore_eos=True), rid="one")

        def fail_the_next_read() -> None:  # on the loop thread, between steps
            loop._callbacks["one"] = cb("one")
            eng.scheduler.submit(one)

            def broken(*args, **kw):
                raise RuntimeError("read failed")

            eng.runner.finish_decode = broken

        loop.call(fail_the_next_read).result(timeout=30)
        assert ended.acquire(timeout=30) and ended.acquire(timeout=30)
        assert got["one"] == [([got["one"][0][0][0]], FinishReason.LENGTH)]  # its token and its end
        assert got["long"][-1][1] is FinishReason.ABORT
        assert loop.call(lambda: dict(loop._callbacks)).result(timeout=10) == {}
        assert loop.check_integrity().result(timeout=10).num_in_use == 0
    finally:
        loop.stop()


def test_a_read_only_step_reads_the_step_in_flight_and_launches_nothing(tiny_model_dir):
    """What the engine loop runs before a paced wait when a step is still in flight (pacing begins): that
    step's tokens come out now, not after the wait, and no new step starts."""
    eng = make_engine(tiny_model_dir, True)
    sch = eng.scheduler
    sch.submit(eng.new_request(prompt(11, 4), GREEDY, rid="r"))
    sch.step()
    sch.step()  # the prefill's token out; a decode step in flight
    assert sch.flights.step is not None
    launches = _count_carried(eng)
    outs = sch.step(launch=False)
    assert [o.rid for o in outs] == ["r"] and len(outs[0].new_token_ids) == 1
    assert sch.flights.step is None and launches == []
    assert sch.step(launch=False) == []  # nothing in flight: nothing to read
