"""Triton's CPU interpreter (TRITON_INTERPRET=1) in a subprocess: ``PRELUDE``, the lines such a subprocess runs first
with numpy >= 2.4, and ``run_interpreted``."""

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
