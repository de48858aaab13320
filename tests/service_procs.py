"""Start real service processes on free ports for tests, and stop (or restart) them."""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field

LOG_DIR_ENV = "NVFP4_TEST_LOG_DIR"  # set: every process's output is also written to DIR/<name>-<pid>.log
_READY = re.compile(r"ready on (\S+):(\d+)")
_ROUTER_READY = re.compile(r"Uvicorn running on https?://(\S+):(\d+)")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    address: str
    lines: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self, sig_kill: bool = False) -> int:
        if self.popen.poll() is None:
            (self.popen.kill if sig_kill else self.popen.terminate)()
            try:
                self.popen.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()
        return self.popen.returncode


class _Launch:
    """A spawned process whose output is pumped into ``lines`` until its ready line shows up."""

    def __init__(self, name: str, cmd: list[str], env: dict[str, str], ready: re.Pattern) -> None:
        self.name, self.cmd, self.env = name, cmd, env
        self.popen = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "PYTHONUNBUFFERED": "1", **env})
        self.lines: list[str] = []
        self.found: list[str] = []
        self.got = threading.Event()
        threading.Thread(target=self._pump, args=(ready,), daemon=True).start()

    def _pump(self, ready: re.Pattern) -> None:
        log_dir = os.environ.get(LOG_DIR_ENV)
        log = open(os.path.join(log_dir, f"{self.name}-{self.popen.pid}.log"), "a") if log_dir else None  # noqa: SIM115
        for line in self.popen.stdout:
            self.lines.append(line)
            if log is not None:
                log.write(line)
                log.flush()
            m = ready.search(line)
            if m and not self.found:
                self.found.append(f"{m.group(1)}:{m.group(2)}")
                self.got.set()
        self.got.set()

    def wait(self, deadline: float) -> Proc:
        while not self.got.wait(0.1):
            if time.monotonic() > deadline:
                self.popen.kill()
                raise TimeoutError(f"{self.name} not ready in time:\n{''.join(self.lines)}")
        if not self.found:
            self.popen.wait()
            raise RuntimeError(f"{self.name} exited with {self.popen.returncode}:\n{''.join(self.lines)}")
        return Proc(self.name, self.popen, self.found[0], self.lines, self.cmd, self.env)


def _service_cmd(module: str, args: tuple[str, ...], port: int = 0) -> list[str]:
    return [sys.executable, "-m", module, "--port", str(port), *args]


def start(module: str, *args: str, timeout: float = 120.0, env: dict | None = None) -> Proc:
    """Run ``python -m module --port 0 args...`` and wait for its "ready on HOST:PORT" line."""
    return _Launch(module, _service_cmd(module, args), env or {}, _READY).wait(time.monotonic() + timeout)


def stop_all(procs: list[Proc]) -> None:
    """Stop ``procs``: SIGTERM to every one still running first, so they shut down together, then wait for each."""
    for p in procs:
        if p.popen.poll() is None:
            p.popen.terminate()
    for p in procs:
        p.stop()


def start_many(specs: list[tuple[str, ...]], timeout: float = 180.0,
               prefill_addresses: tuple[str, ...] = ()) -> list[Proc]:
    """Start several services at once (``(module, *args)`` each, on free ports) and wait for all of them.

    As a deployment does, every decode service started here may pull from the prefill services started here and
    from ``prefill_addresses`` (started before; ``--prefill-addresses``, unless its spec names them itself)."""
    ports = [free_port() if s[0] == "prefill_svc" else 0 for s in specs]
    prefills = [*prefill_addresses, *(f"127.0.0.1:{p}" for p in ports if p)]

    def args(spec: tuple[str, ...]) -> tuple[str, ...]:
        if spec[0] == "decode_svc" and prefills and "--prefill-addresses" not in spec:
            return (*spec[1:], "--prefill-addresses", *prefills)
        return spec[1:]

    launches = [_Launch(s[0], _service_cmd(s[0], args(s), port), {}, _READY) for s, port in zip(specs, ports)]
    deadline = time.monotonic() + timeout
    procs: list[Proc] = []
    try:
        for launch in launches:
            procs.append(launch.wait(deadline))
    except BaseException:
        for launch in launches:
            if launch.popen.poll() is None:
                launch.popen.kill()
        raise
    return procs


def start_router(model_dir: str, decode: list[str], prefill: list[str], *args: str, timeout: float = 60.0,
                 env: dict | None = None) -> Proc:
    """Run ``python -m router`` on a free port and wait until uvicorn listens; ``address`` is host:port."""
    cmd = [sys.executable, "-m", "router", "--port", str(free_port()), "--model-dir", model_dir,
           "--decode-addresses", *decode, "--prefill-addresses", *prefill, "--health-check-interval-s", "0.5",
           *args]
    return _Launch("router", cmd, env or {}, _ROUTER_READY).wait(time.monotonic() + timeout)


def restart(proc: Proc, timeout: float = 120.0) -> Proc:
    """Start ``proc``'s command again on the same port (after it stopped): a restarted worker."""
    if proc.popen.poll() is None:
        raise RuntimeError(f"{proc.name} is still running: stop it before restarting it on port {proc.port}")
    cmd = list(proc.cmd)
    cmd[cmd.index("--port") + 1] = str(proc.port)
    return _Launch(proc.name, cmd, proc.env, _READY).wait(time.monotonic() + timeout)


class Launched:
    """`nvfp4-serve up` on a free port on the CPU, as a user runs it; waits for its ready line."""

    def __init__(self, *args: str) -> None:
        from nvfp4_serve.launcher import free_port as _free_port

        self.port = _free_port()
        self.lines: list[str] = []
        self.proc = subprocess.Popen([sys.executable, "-m", "nvfp4_serve.cli", "up", "--port", str(self.port),
                                      "--device", "cpu", "--dtype", "float32", *args], cwd=ROOT, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     env={**os.environ, "PYTHONUNBUFFERED": "1"})
        self.ready = threading.Event()
        threading.Thread(target=self._pump, daemon=True).start()
        if not self.ready.wait(180) or self.proc.poll() is not None:
            self.proc.kill()
            raise RuntimeError("deployment did not start:\n" + "".join(self.lines))
        self.url = f"http://127.0.0.1:{self.port}"

    def _pump(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line)
            if "nvfp4-serve ready" in line:
                self.ready.set()
        self.ready.set()

    def address(self, role: str) -> str:
        """host:port of the child named ``role`` (prefill, decode-0, ...)."""
        return next(m.group(1) for line in self.lines if (m := re.search(rf"\[{role}\] .*ready on (\S+)", line)))

    def decode_addresses(self) -> list[str]:
        return [m.group(1) for line in self.lines if (m := re.search(r"\[decode-\d+\] .*ready on (\S+)", line))]

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def stop(self) -> int:
        """Ctrl-C (SIGINT) and wait; returns the launcher's exit code."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode
