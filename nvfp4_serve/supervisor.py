"""The launcher's child processes: started so that they end with it, watched, restarted on failure.

    spawn      python -m <service> with its output prefixed "[name] "; on Linux the child asks the kernel
               (prctl PR_SET_PDEATHSIG) for SIGTERM when the launcher dies, even by SIGKILL
    supervise  until Ctrl-C/SIGTERM: a child that dies stops them all (restart "no", the default), or, with
               restart "on-failure", a child that exits non-zero or by a signal is started again with the same
               command and port after a backoff (1 s, doubling to 30 s; reset once it ran 60 s). A child that
               exits 0 (someone stopped it) stops them all either way.
    stop_all   SIGTERM to every child, SIGKILL after the grace period
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

RESTART_POLICIES = ("no", "on-failure")
FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0
STABLE_S = 60.0  # a child that ran this long before it died is restarted after the first backoff again
_READY = re.compile(r"ready on (\S+):(\d+)")
_PR_SET_PDEATHSIG = 1


@dataclass
class Child:
    name: str
    popen: subprocess.Popen
    ready: threading.Event
    address: str = ""
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    started: float = field(default_factory=time.monotonic)
    num_restarts: int = 0
    backoff_s: float = FIRST_BACKOFF_S
    last_error: str = ""  # its last "<prog>: error: ..." line (a refused start-up), repeated when it exits
    output_done: threading.Event = field(default_factory=threading.Event)  # its output was read to the end

    def next_backoff(self, now: float) -> float:
        """Seconds to wait before restarting this (dead) child; doubles with each quick failure."""
        if now - self.started >= STABLE_S:
            self.backoff_s = FIRST_BACKOFF_S
        delay = self.backoff_s
        self.backoff_s = min(MAX_BACKOFF_S, self.backoff_s * 2)
        return delay


def _death_signal() -> Callable[[], None] | None:
    """A preexec_fn that makes the child receive SIGTERM when this process dies (Linux), else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent = os.getpid()

    def preexec() -> None:  # runs in the child between fork and exec: no locks, no allocation beyond ctypes'
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the launcher died before the request was made: nobody will signal us
            os.kill(os.getpid(), signal.SIGTERM)

    return preexec


def spawn(name: str, argv: list[str], env: dict[str, str], *, num_restarts: int = 0,
          backoff_s: float = FIRST_BACKOFF_S) -> Child:
    """Start ``python argv...`` (its own session; it ends when this process ends); its output goes to our stdout
    as ``[name] line``, and its "ready on HOST:PORT" line sets ``ready`` and ``address``."""
    popen = subprocess.Popen([sys.executable, *argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env=env, start_new_session=True, preexec_fn=_death_signal())  # noqa: PLW1509
    child = Child(name, popen, threading.Event(), argv=argv, env=env, num_restarts=num_restarts,
                  backoff_s=backoff_s)

    def pump() -> None:
        try:
            for line in popen.stdout:
                sys.stdout.write(f"[{name}] {line}")
                sys.stdout.flush()
                if ": error: " in line:
                    child.last_error = line.strip()
                m = _READY.search(line)
                if m and not child.ready.is_set():
                    child.address = f"{m.group(1)}:{m.group(2)}"
                    child.ready.set()
        finally:
            child.output_done.set()

    threading.Thread(target=pump, daemon=True).start()
    return child


def supervise(children: list[Child], stop: threading.Event, restart: str = "no") -> int:
    """Watch ``children`` (replaced in place when restarted) until ``stop`` is set (0) or a child dies for good
    (1). Every restart happens on this thread: the death signal is tied to the thread that started a child."""
    if restart not in RESTART_POLICIES:
        raise ValueError(f"--restart must be one of {RESTART_POLICIES}, got {restart!r}")
    due: dict[int, float] = {}  # index of a dead child -> when to start it again
    while not stop.wait(0.2):
        now = time.monotonic()
        for i, c in enumerate(children):
            if i in due:
                if now >= due[i]:
                    del due[i]
                    print(f"nvfp4-serve: restarting {c.name} (restart {c.num_restarts + 1})", file=sys.stderr,
                          flush=True)
                    children[i] = spawn(c.name, c.argv, c.env, num_restarts=c.num_restarts + 1,
                                        backoff_s=c.backoff_s)
                continue
            code = c.popen.poll()
            if code is None:
                continue
            if restart == "no" or code == 0:
                print(f"nvfp4-serve: {c.name} exited with code {code}; stopping all", file=sys.stderr, flush=True)
                return 1
            delay = c.next_backoff(now)
            print(f"nvfp4-serve: {c.name} exited with code {code}; restarting it in {delay:g} s (--restart "
                  f"on-failure)", file=sys.stderr, flush=True)
            due[i] = now + delay
    return 0


def stop_all(children: list[Child], grace: float = 15.0) -> None:
    for c in children:
        if c.popen.poll() is None:
            c.popen.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for c in children:
        try:
            c.popen.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.popen.kill()
            c.popen.wait()
