"""`nvfp4-serve up --prefill-gpus/--decode-gpus`: each service's CUDA_VISIBLE_DEVICES, and the memory split
when services share a GPU (each prefill's pool sized for its prompts in flight; the decodes get the rest)."""

from __future__ import annotations

import pytest

from nvfp4_serve.launcher import _drop_flag, gpu_envs, prefill_pool_tokens, shares_gpu


def test_prefill_on_one_gpu_and_decodes_spread_over_the_others():
    pre, dec = gpu_envs({"A": "1"}, "0", "1,2", 3)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in pre] == ["0"] and pre[0]["A"] == "1"
    assert [e["CUDA_VISIBLE_DEVICES"] for e in dec] == ["1", "2", "1"]


def test_several_prefills_spread_over_their_gpus():
    pre, dec = gpu_envs({}, "0,1", "2", 1, num_prefill=3)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in pre] == ["0", "1", "0"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in dec] == ["2"]


def test_no_placement_inherits_the_environment():
    pre, dec = gpu_envs({"CUDA_VISIBLE_DEVICES": "3"}, None, None, 2)
    assert [e["CUDA_VISIBLE_DEVICES"] for e in pre] == ["3"]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in dec] == ["3", "3"]


def test_prefill_pool_holds_two_workspaces_unless_given():
    assert prefill_pool_tokens(None, 262144, 1 << 20, 8192) == 524288  # the workspace bounds a prompt
    assert prefill_pool_tokens(None, None, 2048, 512) == 4096  # no workspace: the context does
    assert prefill_pool_tokens(100_000, 262144, 1 << 20, 8192) == 100_000
    assert prefill_pool_tokens(None, None, None, 512) is None  # unknown: the engine sizes it from memory
    with pytest.raises(SystemExit, match="--prefill-max-total-tokens 100 is below --chunked-prefill-size 512"):
        prefill_pool_tokens(100, None, 2048, 512)


def test_the_prefill_gets_its_own_pool_size_not_the_decode_one():
    argv = ["--model", "m", "--max-total-tokens", "1048576", "--page-size", "16"]
    assert _drop_flag(argv, "--max-total-tokens") == ["--model", "m", "--page-size", "16"]


@pytest.mark.parametrize("spec", ["", "a", "0,,x", "-1"])
def test_bad_gpu_ids_are_refused_with_the_flag_name(spec):
    with pytest.raises(SystemExit, match="--decode-gpus"):
        gpu_envs({}, None, spec, 1)


def test_a_decode_shares_a_gpu_with_a_prefill_on_the_same_visible_device_or_both_inheriting():
    pre, dec = gpu_envs({}, "0", "1,0", 2)
    assert [shares_gpu(d, pre) for d in dec] == [False, True]
    pre, dec = gpu_envs({"CUDA_VISIBLE_DEVICES": "3"}, None, None, 1)  # both inherit: the same first GPU
    assert shares_gpu(dec[0], pre)
    assert not shares_gpu(dec[0], [])  # no prefill at all
