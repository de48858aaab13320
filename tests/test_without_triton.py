"""A CPU install has no triton (it is not a dependency of ``pip install -e .``): the services, the launcher and an
engine with every CPU feature on (host tier, rotation, nvfp4) import and run with triton unimportable. Guards the
README's first command against a kernel module imported at the top of a served path."""

from __future__ import annotations

import os
import subprocess
import sys

_CODE = """
import sys, tempfile
sys.modules["triton"] = None  # "import triton" now raises, as on a machine without it
import nvfp4_serve.cli, router.app, decode_svc.server, prefill_svc.server  # noqa: F401
from engine.config import CacheConfig, EngineConfig
from engine.engine import Engine
from engine.sampling import SamplingParams
from offline.tiny_model import make_tiny_model

model = make_tiny_model(tempfile.mkdtemp(), head_dim=32)
eng = Engine(EngineConfig(model_dir=str(model), device="cpu", dtype="float32", cache=CacheConfig(
    kv_dtype="nvfp4", kv_rotation="hadamard", page_size=4, max_total_tokens=64, host_cache_tokens=256)))
outs = eng.generate([list(range(3, 40)), list(range(5, 50))], SamplingParams(temperature=0, max_tokens=4))
assert all(len(o.token_ids) == 4 for o in outs)
assert "triton" not in {m.split(".")[0] for m, v in sys.modules.items() if v is not None}
print("ran without triton")
"""


def test_the_services_and_a_cpu_engine_run_without_triton():
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run([sys.executable, "-c", _CODE], cwd=repo, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0 and "ran without triton" in res.stdout, res.stdout[-2000:] + res.stderr[-3000:]
