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
INTERVAL = 0.08


@pytest.fixture()
def engine(tiny_model_dir):
    return Engine(EngineConfig(model_dir=tiny_model_dir, device="cpu", dtype="float32",
                               cache=CacheConfig(kv_dtype="nvfp4", page_size=4, max_total_tokens=512)))


def _decode(loop: EngineLoop, rid: str) -> tuple[list[int], list[float]]:
    """Token ids and arrival times of one local request of 8 tokens."""
    tokens, times, done = [], [], threading.Event()

    def on_output(out):
        if hasattr(out, "new_token_ids"):
            tokens.extend(out.new_token_ids)
            times.extend([time.perf_counter()] * len(out.new_token_ids))
            if out.finish_reason:
                done.set()
    loop.submit(Request(rid, [5, 6, 7, 8, 9, 10], SP), on_output)
    assert done.wait(60)
    return tokens, times


def _gaps(times: list[float]) -> list[float]:
    return [b - a for a, b in itertools.pairwise(times[1:])]  # decode steps (the first token is the prefill's)


def test_decode_steps_are_paced_only_while_a_pull_is_in_flight(engine):
    loop = EngineLoop(engine, decode_interval_while_pulling_s=INTERVAL).start()
    try:
        free_tokens, free_times = _decode(loop, "alone")
        assert max(_gaps(free_times)) < INTERVAL  # nothing pulled: full speed
        started = threading.Event()
        loop.submit(Request("pulled", [3] * 9, SP, remote_prefill=True),
                    lambda ev: started.set() if isinstance(ev, PullStart) else None)
        assert started.wait(30)  # admitted, its pull in flight (never completed here)
        paced_tokens, paced_times = _decode(loop, "beside-a-pull")
        assert paced_tokens == free_tokens  # pacing changes when steps run, never what they compute
        gaps = _gaps(paced_times)
        assert min(gaps) >= INTERVAL * 0.9, gaps
        loop.abort("pulled")
        _, after = _decode(loop, "after")
        assert max(_gaps(after)) < INTERVAL
        assert engine.check_integrity().num_in_use == 0
    finally:
        loop.stop()


def test_a_negative_interval_is_refused(engine):
    with pytest.raises(ValueError, match=">= 0"):
        EngineLoop(engine, decode_interval_while_pulling_s=-1)
