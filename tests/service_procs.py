"""Start real service processes on free ports for tests, and stop them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

_READY = re.compile(r"ready on (\S+):(\d+)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    address: str
    lines: list[str] = field(default_factory=list)

    def stop(self, sig_kill: bool = False) -> int:
        if self.popen.poll() is None:
            (self.popen.kill if sig_kill else self.popen.terminate)()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


def start(module: str, *args: str, timeout: float = 120.0, env: dict | None = None) -> Proc:
    """Run ``python -m module --port 0 args...`` and wait for its "ready on HOST:PORT" line."""
    cmd = [sys.executable, "-m", module, "--port", "0", *args]
    popen = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
    lines: list[str] = []
    found: list[str] = []
    got = threading.Event()

    def pump() -> None:
        for line in popen.stdout:
            lines.append(line)
            m = _READY.search(line)
            if m and not found:
                found.append(f"{m.group(1)}:{m.group(2)}")
                got.set()
        got.set()

    threading.Thread(target=pump, daemon=True).start()
    deadline = time.monotonic() + timeout
    while not got.wait(0.1):
        if time.monotonic() > deadline:
            popen.kill()
            raise TimeoutError(f"{module} not ready after {timeout} s:\n{''.join(lines)}")
    if not found:
        popen.wait()
        raise RuntimeError(f"{module} exited with {popen.returncode}:\n{''.join(lines)}")
    return Proc(module, popen, found[0], lines)
