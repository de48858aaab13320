"""Triton's CPU interpreter (TRITON_INTERPRET=1) in a subprocess: ``PRELUDE``, the lines such a subprocess runs first
with numpy >= 2.4, ``run_interpreted`` and ``interpreted_cases``."""

import os
import subprocess
import sys

PRELUDE = '''
import triton.runtime.interpreter as ti
_orig = ti._patch_lang_tensor
def _patched(tensor, scope):  # numpy >= 2.4 refuses int() of a 1-element array; triton 3.6 relies on it
    _orig(tensor, scope)
    scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))
ti._patch_lang_tensor = _patched
'''


def run_interpreted(code: str, timeout: float = 600) -> subprocess.CompletedProcess[str]:
    """``code`` in a fresh interpreter with TRITON_INTERPRET=1 and the repository importable (the interpreter is
    chosen before any kernel is defined, hence a subprocess); its output captured, never raising on failure."""
    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=repo + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run([sys.executable, "-c", code], cwd=repo, env=env, capture_output=True, text=True,
                          check=False, timeout=timeout)


def interpreted_cases(kernel: str, cases_module: str) -> tuple[int | None, str]:
    """``check_cases(kernel, "cpu")`` of ``cases_module`` (it returns how many cases it checked) under the
    interpreter, ``kernel`` named "module:function": (that count, or None where the run failed; its output)."""
    module, name = kernel.split(":")
    res = run_interpreted(f"from {module} import {name}\nfrom {cases_module} import check_cases\n"
                          f"print('cases', check_cases({name}, 'cpu'))\n")
    counts = [line.split()[1] for line in res.stdout.splitlines() if line.startswith("cases ")]
    ok = res.returncode == 0 and len(counts) == 1
    return (int(counts[0]) if ok else None), res.stdout[-2000:] + res.stderr[-4000:]
