"""One request that breaks its own step fails alone: the others in the batch go on with the tokens they would
have produced, and the pool stays whole (its pages are freed, never cached)."""

from __future__ import annotations

import pytest

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.outcome import FailureKind, FinishReason
from engine.request import Request, Status, StepOutput
from engine.sampling import SamplingParams

SP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def engine(model_dir: str, overlap: bool = True) -> Engine:
    return Engine(EngineConfig(model_dir=model_dir, device="cpu", dtype="float32",
                               cache=CacheConfig(kv_dtype="nvfp4", page_size=4, max_total_tokens=1024),
                               scheduler=SchedulerConfig(disable_overlap_schedule=not overlap)))


def prompt(n: int, offset: int) -> list[int]:
    return [(offset + 7 * i) % 400 + 3 for i in range(n)]


def run(eng: Engine, steps: int | None = None, outs: dict | None = None) -> dict[str, list[StepOutput]]:
    """Step until idle (or ``steps`` times), collecting every request's outputs into ``outs``."""
    outs = {} if outs is None else outs
    n = 0
    while eng.scheduler.has_work and (steps is None or n < steps):
        for o in eng.scheduler.step():
            if isinstance(o, StepOutput):
                outs.setdefault(o.rid, []).append(o)
        n += 1
    return outs


@pytest.mark.parametrize("overlap", [False, True])
def test_a_request_whose_decode_step_fails_ends_alone(tiny_model_dir, overlap):
    ref = engine(tiny_model_dir).generate([prompt(21, 1), prompt(13, 2)], SP)
    eng = engine(tiny_model_dir, overlap)
    good, bad = Request("good", prompt(21, 1), SP), Request("bad", prompt(13, 2), SP)
    eng.scheduler.submit(good)
    outs = run(eng, steps=2)  # "good" decodes: with overlap its tokens are read on the device from now on
    extend = eng.runner.extend

    def bad_first_token(reqs, lens, mask):  # the extend hands "bad" a token no embedding row holds
        return [eng.model_config.vocab_size + 5 if r is bad and t is not None else t
                for r, t in zip(reqs, extend(reqs, lens, mask))]

    eng.runner.extend = bad_first_token
    eng.scheduler.submit(bad)
    run(eng, outs=outs)  # the decode step that reads it from the host raises before any device work
    assert [t for o in outs["good"] for t in o.new_token_ids] == ref[0].token_ids
    assert outs["bad"][-1].finish_reason is FinishReason.ABORT and "decode step" in outs["bad"][-1].failure.message
    assert outs["bad"][-1].failure.kind is FailureKind.INTERNAL
    assert bad.status is Status.FINISHED and not bad.page_ids
    rep = eng.check_integrity()
    # its prompt's pages were cached when its prefill finished (sound); nothing it wrote after is
    assert rep.num_in_use == 0 and eng.cache.match_prefix(bad.prompt_ids + [1] * 8).num_tokens == 12


def test_a_request_whose_prefill_chunk_fails_ends_alone(tiny_model_dir):
    ref = engine(tiny_model_dir).generate([prompt(21, 1)], SP)
    eng = engine(tiny_model_dir)
    bad_ids = prompt(13, 2)
    bad_ids[5] = eng.model_config.vocab_size + 1  # validation bypassed: the engine itself must cope
    good, bad = Request("good", prompt(21, 1), SP), Request("bad", bad_ids, SP)
    eng.scheduler.submit(good)
    eng.scheduler.submit(bad)
    outs = run(eng)
    assert [t for o in outs["good"] for t in o.new_token_ids] == ref[0].token_ids
    assert outs["bad"][-1].finish_reason is FinishReason.ABORT and "prefill" in outs["bad"][-1].failure.message
    assert outs["bad"][-1].failure.kind is FailureKind.INTERNAL
    assert eng.check_integrity().num_in_use == 0


def test_a_first_token_outside_the_vocabulary_fails_only_that_pull(tiny_model_dir):
    eng = engine(tiny_model_dir)
    req = Request("p", prompt(9, 3), SP, remote_prefill=True)
    eng.scheduler.submit(req)
    eng.scheduler.step()  # admitted: pages allocated, waiting for the pull
    out = eng.scheduler.complete_pull("p", -1)
    assert out.finish_reason is FinishReason.ABORT and "outside the vocabulary" in out.failure.message
    assert not eng.scheduler.pulling and eng.check_integrity().num_in_use == 0
