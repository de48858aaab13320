"""Start ``nvfp4-serve up`` for a benchmark, wait until it is ready, and stop it with SIGINT (Ctrl-C).

The launcher's output (every service's log) goes to a log file, so the progress bar stays readable; when
the deployment fails to start, the error quotes the log's last lines.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from svc_common.free_port import free_port

_READY = re.compile(r"nvfp4-serve ready: (\S+)")
REPO_ROOT = Path(__file__).resolve().parents[2]


def launcher_command(args: list[str]) -> list[str]:
    """``python -m nvfp4_serve.cli up ARGS``, with ``--port`` set to a free one unless ARGS give it."""
    args = list(args)
    if not any(a == "--port" or a.startswith("--port=") for a in args):
        args += ["--port", str(free_port())]
    return [sys.executable, "-m", "nvfp4_serve.cli", "up", *args]


class LaunchedDeployment:
    """``with LaunchedDeployment(args, log_path) as d: ... d.base_url ...``; stops the deployment on exit."""

    def __init__(self, args: list[str], log_path: str | Path, timeout_s: float = 900.0,
                 stop_timeout_s: float = 60.0) -> None:
        self.args = list(args)
        self.command = launcher_command(self.args)
        self.log_path = Path(log_path)
        self.timeout_s, self.stop_timeout_s = timeout_s, stop_timeout_s
        self.base_url = ""
        self._popen: subprocess.Popen[str] | None = None
        self._ready = threading.Event()
        self._tail: list[str] = []

    def _pump(self, popen: subprocess.Popen[str]) -> None:
        with self.log_path.open("w") as log:
            for line in popen.stdout or ():
                log.write(line)
                log.flush()
                self._tail = [*self._tail[-39:], line]
                m = _READY.search(line)
                if m and not self._ready.is_set():
                    url = m.group(1).removesuffix("/v1").replace("://0.0.0.0:", "://127.0.0.1:")
                    self.base_url = url
                    self._ready.set()
        self._ready.set()  # EOF: the launcher exited; start() sees it

    def start(self) -> str:
        """Start and wait for the ready line; returns the base URL. Raises RuntimeError (with the log's tail)
        when the launcher exits or is not ready within ``timeout_s``."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": pythonpath}
        print(f"launching: {' '.join(self.command)}\n  (log: {self.log_path})", file=sys.stderr, flush=True)
        self._popen = subprocess.Popen(self.command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                       text=True, env=env)
        threading.Thread(target=self._pump, args=(self._popen,), daemon=True).start()
        deadline = time.monotonic() + self.timeout_s
        while not self._ready.wait(0.2):
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"nvfp4-serve up was not ready after {self.timeout_s:g} s "
                                   f"(--launch-timeout); last lines of {self.log_path}:\n"
                                   + "".join(self._tail))
        if not self.base_url:
            code = self._popen.wait()
            raise RuntimeError(f"nvfp4-serve up exited with code {code} before it was ready; last lines of "
                               f"{self.log_path}:\n{''.join(self._tail)}")
        return self.base_url

    def stop(self) -> int | None:
        """SIGINT (the launcher stops every service), then SIGKILL after ``stop_timeout_s``; the exit code."""
        p = self._popen
        if p is None:
            return None
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            try:
                p.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        return p.returncode

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()
