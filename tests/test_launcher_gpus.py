"""`nvfp4-serve up --prefill-gpus/--decode-gpus`: each service's CUDA_VISIBLE_DEVICES."""

from __future__ import annotations

import pytest

from nvfp4_serve.launcher import gpu_envs


def test_prefill_on_one_gpu_and_decodes_spread_over_the_others():
    pre, dec = gpu_envs({"A": "1"}, "0", "1,2", 3)
    assert pre["CUDA_VISIBLE_DEVICES"] == "0" and pre["A"] == "1"
    assert [e["CUDA_VISIBLE_DEVICES"] for e in dec] == ["1", "2", "1"]


def test_no_placement_inherits_the_environment():
    pre, dec = gpu_envs({"CUDA_VISIBLE_DEVICES": "3"}, None, None, 2)
    assert pre["CUDA_VISIBLE_DEVICES"] == "3" and [e["CUDA_VISIBLE_DEVICES"] for e in dec] == ["3", "3"]


@pytest.mark.parametrize("spec", ["", "a", "0,,x", "-1"])
def test_bad_gpu_ids_are_refused_with_the_flag_name(spec):
    with pytest.raises(SystemExit, match="--decode-gpus"):
        gpu_envs({}, None, spec, 1)
