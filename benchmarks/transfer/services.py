"""Prefill and decode service processes for the transfer benchmark: start many at once on given GPUs,
wait for their ready lines, read their metrics, stop them."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc, prefill_pb2_grpc

_READY = re.compile(r"ready on (\S+):(\d+)")
REPO_ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Service:
    name: str
    popen: subprocess.Popen
    log_path: Path
    address: str = ""
    ready: threading.Event = field(default_factory=threading.Event)
    tail: list[str] = field(default_factory=list)

    def stop(self, grace_s: float = 20.0) -> None:
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait()


def spawn(name: str, module: str, args: list[str], log_dir: Path, gpu: str | None) -> Service:
    """``python -m module --port 0 args`` with CUDA_VISIBLE_DEVICES=gpu (None: inherited); output to a log."""
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if gpu is not None:
        env["CUDA_VISIBLE_DEVICES"] = gpu
    log_path = log_dir / f"{name}.log"
    popen = subprocess.Popen([sys.executable, "-m", module, "--port", "0", *args], cwd=REPO_ROOT, env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    svc = Service(name, popen, log_path)

    def pump() -> None:
        with log_path.open("w") as log:
            for line in popen.stdout or ():
                log.write(line)
                log.flush()
                svc.tail = [*svc.tail[-29:], line]
                m = _READY.search(line)
                if m and not svc.ready.is_set():
                    svc.address = f"{m.group(1)}:{m.group(2)}"
                    svc.ready.set()
        svc.ready.set()

    threading.Thread(target=pump, daemon=True).start()
    return svc


def stop_all(groups: dict[str, dict[str, Service]]) -> None:
    """Stop every service of ``start_services``'s groups."""
    for group in groups.values():
        for s in group.values():
            s.stop()


def invocation(module: str, argv: list[str] | None) -> str:
    """The command line that ran ``module`` with ``argv`` (None: this process's own arguments)."""
    return f"python -m {module} " + shlex.join(sys.argv[1:] if argv is None else argv)


def wait_ready(services: list[Service], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    for s in services:
        while not s.ready.wait(0.2):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{s.name} not ready within {timeout_s:g} s; log {s.log_path}")
        if not s.address:
            raise RuntimeError(f"{s.name} exited with {s.popen.wait()} during start-up:\n{''.join(s.tail)}")


def metrics(address: str, role: str) -> dict[str, float]:
    """Every sample of the service's Prometheus text, by ``name{labels}``."""
    with grpc.insecure_channel(address) as ch:
        stub = (prefill_pb2_grpc.PrefillStub if role == "prefill" else decode_pb2_grpc.DecodeStub)(ch)
        text = stub.GetMetrics(common_pb2.MetricsRequest(), timeout=30).prometheus_text
    out = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name] = float(value)
    return out


def flush_decode_cache(address: str) -> None:
    with grpc.insecure_channel(address) as ch:
        decode_pb2_grpc.DecodeStub(ch).FlushCache(decode_pb2.FlushCacheRequest(), timeout=60)


def delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)
