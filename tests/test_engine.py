"""The offline engine end to end on CPU: the three attention paths, chunking, prefix reuse, batching."""

from __future__ import annotations

import pytest
import torch

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from engine.engine import Engine
from engine.model import causal_attention_no_cache
from engine.outcome import FinishReason
from engine.sampling import SamplingParams
from tests.engine_reference import PathReference

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def make_engine(model_dir: str, kv_dtype: str = "nvfp4", page_size: int = 4, chunk_size: int = 64,
                max_total_tokens: int = 2048, **sched) -> Engine:
    return Engine(EngineConfig(
        model_dir=model_dir, device="cpu", dtype="float32",
        cache=CacheConfig(kv_dtype=kv_dtype, page_size=page_size, max_total_tokens=max_total_tokens),
        scheduler=SchedulerConfig(chunk_size=chunk_size, **sched)))


def prompt_ids(n: int, seed: int, vocab: int = 500) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@pytest.mark.parametrize("kv_dtype", ["bf16", "fp8_e4m3", "nvfp4"])
@pytest.mark.parametrize("chunk_size", [64, 7])
def test_greedy_tokens_follow_the_path_reference(tiny_model_dir, kv_dtype, chunk_size):
    eng = make_engine(tiny_model_dir, kv_dtype, chunk_size=chunk_size)
    prompt = prompt_ids(29, seed=1)
    out = eng.generate([prompt], GREEDY)[0]
    ref_tokens, _ = PathReference(eng.model, kv_dtype).greedy(prompt, GREEDY.max_tokens, chunk_size)
    assert out.token_ids == ref_tokens
    eng.check_integrity()


def test_bf16_cached_decode_matches_full_recompute_without_cache(tiny_model_dir):
    eng = make_engine(tiny_model_dir, "bf16")
    prompt = prompt_ids(21, seed=2)
    tokens, logits = PathReference(eng.model, "bf16").greedy(prompt, 8, chunk_size=64)
    seq = prompt + tokens
    with torch.inference_mode():
        ids = torch.tensor(seq)
        hidden = eng.model(ids, torch.arange(len(seq)), causal_attention_no_cache([len(seq)]))
        full = eng.model.compute_logits(hidden)
    for i, lg in enumerate(logits):
        exact = full[len(prompt) - 1 + i]
        # K/V rounded to bf16 (8 mantissa bits) vs exact fp32: well within bf16 rounding of the logits
        assert (lg - exact).abs().max().item() < 2e-2 * exact.abs().max().item() + 1e-3
    assert eng.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))[0].token_ids == tokens


def test_nvfp4_path_reference_differs_from_bf16(tiny_model_dir):
    """Guard: the path reference really applies NVFP4 (otherwise the tests above prove little)."""
    eng = make_engine(tiny_model_dir, "nvfp4")
    prompt = prompt_ids(40, seed=3)
    _, lg_nv = PathReference(eng.model, "nvfp4").greedy(prompt, 3, chunk_size=8)
    _, lg_bf = PathReference(eng.model, "bf16").greedy(prompt, 3, chunk_size=8)
    assert (lg_nv[-1] - lg_bf[-1]).abs().max().item() > 1e-4


def test_repeated_prefix_reports_cached_tokens_and_runs_the_extend_path(tiny_model_dir):
    eng = make_engine(tiny_model_dir, "nvfp4", chunk_size=16)
    shared = prompt_ids(40, seed=4)
    first = eng.generate([shared + [7, 8, 9]], GREEDY)[0]
    assert first.num_cached_tokens == 0
    second = eng.generate([shared + [10, 11]], GREEDY)[0]
    assert second.num_cached_tokens == 40  # 10 full pages of 4 tokens
    ref, _ = PathReference(eng.model, "nvfp4").greedy(shared + [10, 11], GREEDY.max_tokens, chunk_size=40)
    assert second.token_ids == ref  # prefix of 40 tokens from the pool, then the rest as one chunk
    eng.check_integrity()


@pytest.mark.parametrize(("kv_dtype", "chunk_size"), [("bf16", 16), ("nvfp4", 64)])
def test_continuous_batching_gives_each_request_its_solo_output(tiny_model_dir, kv_dtype, chunk_size):
    # bf16: chunk boundaries do not change the numerics, so chunks shared between requests are fine;
    # nvfp4: a prefix read back from the pool is rounded twice, so every prompt fits one chunk here.
    prompts = [prompt_ids(n, seed=10 + n) for n in (5, 17, 33, 8)]
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 9, 6, 12)]
    batched = make_engine(tiny_model_dir, kv_dtype, chunk_size=chunk_size).generate(prompts, params)
    for p, sp, b in zip(prompts, params, batched):
        solo = make_engine(tiny_model_dir, kv_dtype, chunk_size=chunk_size).generate([p], sp)[0]
        assert b.token_ids == solo.token_ids and len(b.token_ids) == sp.max_tokens
        assert b.finish_reason is FinishReason.LENGTH


def test_greedy_is_deterministic_and_seeded_sampling_repeats(tiny_model_dir):
    p = prompt_ids(12, seed=5)
    a = make_engine(tiny_model_dir).generate([p], GREEDY)[0].token_ids
    b = make_engine(tiny_model_dir).generate([p], GREEDY)[0].token_ids
    assert a == b
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=10, ignore_eos=True)
    # fresh engines: a repeat on the same engine reads the prompt back from the NVFP4 cache
    # (the extend path), whose numerics differ from the first run's FP8 prefill
    first = make_engine(tiny_model_dir).generate([p], sp)[0].token_ids
    assert make_engine(tiny_model_dir).generate([p], sp)[0].token_ids == first
    other = SamplingParams(temperature=1.0, top_p=0.9, seed=4321, max_tokens=10, ignore_eos=True)
    assert make_engine(tiny_model_dir).generate([p], other)[0].token_ids != first


def test_pool_pressure_evicts_and_retracts_without_leaking(tiny_model_dir):
    # 24 pages of 4 tokens: four 20-token prompts growing by 16 tokens cannot all stay resident.
    # bf16 so that a retracted request's re-prefill reproduces its solo numerics exactly.
    eng = make_engine(tiny_model_dir, "bf16", max_total_tokens=96, decode_reserve_tokens=0)
    prompts = [prompt_ids(20, seed=20 + i) for i in range(4)]
    sp = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    outs = eng.generate(prompts, sp)
    assert all(len(o.token_ids) == 16 for o in outs)
    assert eng.scheduler.num_retractions > 0
    for p, o in zip(prompts, outs):
        solo = make_engine(tiny_model_dir, "bf16").generate([p], sp)[0]
        assert o.token_ids == solo.token_ids
    report = eng.check_integrity()
    assert report.num_in_use == 0


def test_stop_token_and_max_tokens_finish_reasons(tiny_model_dir):
    p = prompt_ids(10, seed=6)
    free_run = make_engine(tiny_model_dir).generate([p], GREEDY)[0].token_ids
    stop_at = free_run[3]
    sp = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=(stop_at,), ignore_eos=True)
    out = make_engine(tiny_model_dir).generate([p], sp)[0]
    assert out.finish_reason is FinishReason.STOP and out.token_ids == free_run[:free_run.index(stop_at) + 1]
    one = make_engine(tiny_model_dir).generate([p], SamplingParams(temperature=0, max_tokens=1, ignore_eos=True))[0]
    assert one.finish_reason is FinishReason.LENGTH and len(one.token_ids) == 1


def test_nvfp4_pool_holds_16_9_the_tokens_of_fp8_for_the_same_bytes(tiny_model_dir):
    from engine.kv_pool import KVPool

    budget = 1 << 20
    args = {"num_layers": 2, "page_size": 4, "num_kv_heads": 2, "head_dim": 16}
    n8 = KVPool.num_pages_for_budget(budget, "fp8_e4m3", **args)
    n4 = KVPool.num_pages_for_budget(budget, "nvfp4", **args)
    c8 = KVPool("fp8_e4m3", num_pages=n8, **args).capacity()
    c4 = KVPool("nvfp4", num_pages=n4, **args).capacity()
    assert c4.total_bytes <= budget and c8.total_bytes <= budget
    assert abs(c4.max_tokens / c8.max_tokens - 16 / 9) < 0.01


def test_bad_configs_fail_with_clear_messages(tmp_path):
    from offline.tiny_model import make_tiny_model

    odd = make_tiny_model(tmp_path / "hd24", head_dim=24)
    with pytest.raises(ValueError, match="nvfp4 needs head_dim divisible by 16"):
        make_engine(str(odd), "nvfp4")
    make_engine(str(odd), "fp8_e4m3")  # other dtypes accept it
    with pytest.raises((FileNotFoundError, ValueError), match="does not exist|config.json"):
        make_engine(str(tmp_path / "missing"))
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        CacheConfig(kv_dtype="int4")


def test_prompt_too_long_is_rejected_with_its_length(tiny_model_dir):
    from engine.scheduler import RequestRejected

    eng = make_engine(tiny_model_dir, max_total_tokens=64)
    with pytest.raises(RequestRejected, match="70 tokens"):
        eng.generate([prompt_ids(70, seed=7)], GREEDY)
