"""The launcher's children live and die with it: a real ``nvfp4-serve up`` killed with SIGKILL takes every
service with it; by default a service that dies stops the deployment; with ``--restart on-failure`` a killed
service is started again on its port and the router serves through it once it is healthy."""

from __future__ import annotations

import os
import select
import signal
import socket
import time

import httpx
import openai
import pytest

from tests.service_procs import Launched

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="Linux: the death signal is prctl's")


def _children(pid: int) -> dict[int, str]:
    """pid -> command line of the processes whose parent is ``pid``."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            if ppid == pid:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    out[int(entry)] = f.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
    return out


def _wait_gone(pids: list[int], timeout: float) -> list[int]:
    """Wait (on pidfds: the kernel says when each process ends) until every pid has ended; the ones left."""
    poller, fds = select.poll(), {}
    for pid in pids:
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        fds[fd] = pid
        poller.register(fd, select.POLLIN)
    deadline = time.monotonic() + timeout
    while fds and time.monotonic() < deadline:
        for fd, _ in poller.poll(max(1, int((deadline - time.monotonic()) * 1000))):
            poller.unregister(fd)
            os.close(fd)
            fds.pop(fd)
    for fd in fds:
        os.close(fd)
    return list(fds.values())


def _role(children: dict[int, str], module: str) -> int:
    return next(pid for pid, cmd in children.items() if f"-m {module} " in cmd)


def _wait_for_line(d: Launched, text: str, count: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while sum(text in line for line in d.lines) < count:
        assert time.monotonic() < deadline and d.proc.poll() is None, d.output[-3000:]
        time.sleep(0.05)


def test_without_restart_a_dead_service_stops_the_deployment(tiny_model_dir):
    d = Launched("--model", tiny_model_dir, "--page-size", "4", "--num-prefill", "0")
    try:
        children = _children(d.proc.pid)
        os.kill(_role(children, "decode_svc"), signal.SIGKILL)
        assert d.proc.wait(timeout=60) == 1
        assert "decode-0 exited with code -9; stopping all" in d.output
        assert _wait_gone(list(children), 30) == []
    finally:
        d.stop()


def test_restart_on_failure_brings_a_killed_service_back_and_sigkill_of_up_ends_every_child(tiny_model_dir):
    d = Launched("--model", tiny_model_dir, "--page-size", "4", "--restart", "on-failure")
    try:
        decode = _role(_children(d.proc.pid), "decode_svc")
        os.kill(decode, signal.SIGKILL)
        _wait_for_line(d, "decode-0 exited with code -9; restarting it in 1 s", 1, 30)
        _wait_for_line(d, "[decode-0] decode service ready on", 2, 120)
        with httpx.Client(base_url=d.url, timeout=30) as c:  # the router polls its workers' health
            deadline = time.monotonic() + 30
            while c.get("/health").status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.1)
        client = openai.OpenAI(base_url=d.url + "/v1", api_key="x", max_retries=0)
        out = client.completions.create(model="model", prompt="def f(x):", max_tokens=3,
                                        extra_body={"ignore_eos": True})
        assert out.usage.completion_tokens == 3
        children = _children(d.proc.pid)
        assert {_role(children, m) for m in ("prefill_svc", "decode_svc", "router")} <= set(children)
        assert decode not in children
        os.kill(d.proc.pid, signal.SIGKILL)  # no chance to stop anything itself
        assert _wait_gone(list(children), 30) == []
        with pytest.raises(OSError):
            socket.create_connection(("127.0.0.1", d.port), timeout=5).close()
    finally:
        d.stop()
