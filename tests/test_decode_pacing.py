"""A decode paced while prompts are pulled (engine/engine_loop.py ``decode_interval_while_pulling_s``): its
decode-only steps start at least the interval apart while a pull is in flight, at full speed otherwise, and
the tokens are the same ones."""

from __future__ import annotations

import itertools
import threading
import time

import pytest

from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.engine_loop import EngineLoop
from engine.request import PullStart, Request
from engine.sampling import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
INTERVAL = 0.2  # far above a tiny model's CPU step, even on a loaded 2-core machine


@pytest.fixture()
def engine(tiny_model_dir):
    return Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32",
                               cache=CacheConfig(kv_dtype="nvfp4", page_size=4, max_total_tokens=512)))


def _decode(loop: EngineLoop, rid: str) -> list[int]:
    """Token ids of one local request of 8 tokens."""
    tokens, done = [], threading.Event()

    def on_output(out):
        if hasattr(out, "new_token_ids"):
            tokens.extend(out.new_token_ids)
            if out.finish_reason:
                done.set()
    loop.submit(Request(rid, [5, 6, 7, 8, 9, 10], SP), on_output)
    assert done.wait(60)
    return tokens


def _record_step_starts(loop: EngineLoop) -> list[float]:
    """When each scheduler step begins (perf_counter), appended by the loop thread: pacing is a rule on step
    starts, so the test reads those and not token arrival times (which also carry each step's duration, and
    that varies with the machine's load)."""
    starts: list[float] = []
    step = loop.scheduler.step

    def timed_step(*args, **kwargs):
        if kwargs.get("launch", True):  # not a read of the step left in flight before a paced wait
            starts.append(time.perf_counter())
        return step(*args, **kwargs)
    loop.scheduler.step = timed_step
    return starts


def _decode_step_gaps(loop: EngineLoop, starts: list[float], rid: str) -> tuple[list[int], list[float]]:
    """Tokens of one request decoded alone, and the gaps between its decode steps' starts."""
    first = len(starts)
    tokens = _decode(loop, rid)
    mine = starts[first:]  # its prefill step, then its decode steps
    return tokens, [b - a for a, b in itertools.pairwise(mine[1:])]


def test_decode_steps_are_paced_only_while_a_pull_is_in_flight(engine):
    loop = EngineLoop(engine, decode_interval_while_pulling_s=INTERVAL).start()
    starts = _record_step_starts(loop)
    try:
        free_tokens, free_gaps = _decode_step_gaps(loop, starts, "alone")
        assert sum(free_gaps) / len(free_gaps) < INTERVAL / 2, free_gaps  # nothing pulled: full speed
        started = threading.Event()
        loop.submit(Request("pulled", [3] * 9, SP, remote_prefill=True),
                    lambda ev: started.set() if isinstance(ev, PullStart) else None)
        assert started.wait(30)  # admitted, its pull in flight (never completed here)
        launch, carried = engine.runner.launch_decode, []

        def traced(reqs, carry=None):
            carried.append(carry is not None and any(r >= 0 for r in carry.rows))
            return launch(reqs, carry)

        engine.runner.launch_decode = traced
        paced_tokens, paced_gaps = _decode_step_gaps(loop, starts, "beside-a-pull")
        engine.runner.launch_decode = launch
        assert paced_tokens == free_tokens  # pacing changes when steps run, never what they compute
        # a paced step is read before the wait after it (no step left in flight across the interval)
        assert carried and not any(carried)
        assert len(paced_gaps) >= 4 and min(paced_gaps) >= INTERVAL, paced_gaps
        loop.abort("pulled")
        _, after = _decode_step_gaps(loop, starts, "after")
        assert sum(after) / len(after) < INTERVAL / 2, after
        assert engine.check_integrity().num_in_use == 0
    finally:
        loop.stop()


def test_a_negative_interval_is_refused(engine):
    with pytest.raises(ValueError, match=">= 0"):
        EngineLoop(engine, decode_interval_while_pulling_s=-1)
