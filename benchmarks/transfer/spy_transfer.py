"""Where the gRPC KV transfer's CPU time goes, per process and thread: py-spy sampling of a prefill and a decode
service while the same ready prompt moves between them again and again.

    python -m benchmarks.transfer.spy_transfer [--model DIR --num-layers N] [--length 32768]
        [--kv-dtypes nvfp4 fp8_e4m3] [--seconds 6] [--native]

For each KV dtype: one prefill and one ``--kv-transfer grpc`` decode (``bench_transfer.start_services``), one
prompt computed once (its pages then sit in the prefill's cache), then two windows of ``--seconds`` each in
which the prompt is sent again and again (the decode's cache flushed each time, so every page moves):

    cpu   py-spy samples of threads running on a CPU (sleeping and blocked threads are not sampled):
          a thread's share is its CPU use over the window;
    gil   samples of the thread holding the GIL only: the shares add up to how busy the GIL is.

Per process, thread and window: the share, the innermost frames of this repository's code and the leaf
frames (native ones with ``--native``). Needs ``py-spy`` (``pip install py-spy``) and the right to trace the
services (root, or ptrace allowed). Writes docs/benchmarks/transfer_spy.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any

from benchmarks.transfer.bench_transfer import build_arg_parser as transfer_parser
from benchmarks.transfer.bench_transfer import prepare_model, run_one, start_services
from benchmarks.transfer.services import REPO_ROOT, invocation, stop_all

_THREAD = re.compile(r"^thread \((0x[0-9a-f]+|\d+)\)(?::\s*(.*))?$")
_FRAME = re.compile(r"^(.*) \((.*?)(?::(\d+))?\)$")
_TOP = 8


def parse_collapsed(text: str) -> dict[str, dict[str, Any]]:
    """py-spy's raw (collapsed) output with ``--threads`` -> {thread name: {"samples": n, "ours": Counter,
    "leaf": Counter}}: "ours" counts the innermost frame of this repository's code in each sample (file:function),
    "leaf" the sample's innermost frame of any code (native frames included)."""
    out: dict[str, dict[str, Any]] = defaultdict(lambda: {"samples": 0, "ours": Counter(), "leaf": Counter()})
    root = str(REPO_ROOT) + "/"
    for line in text.splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        if frames and frames[0].startswith("process "):
            frames = frames[1:]
        m = _THREAD.match(frames[0]) if frames else None
        if m is None:
            continue
        name = (m.group(2) or m.group(1)).strip()
        name = re.sub(r"_\d+$", "", name)  # pool threads: one row per pool
        t = out[name]
        n = int(count)
        t["samples"] += n
        rest = frames[1:]
        if rest:
            t["leaf"][_short(rest[-1], root)] += n
        ours = [f for f in rest if root in f or _is_ours(f)]
        t["ours"][_short(ours[-1], root) if ours else "(none of ours)"] += n
    return dict(out)


def _is_ours(frame: str) -> bool:
    m = _FRAME.match(frame)
    if not m:
        return False
    path = m.group(2)
    return not path.startswith("/") and path.split("/")[0] in _PACKAGES


_PACKAGES = {p.name for p in REPO_ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}


def _short(frame: str, root: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame[:120]
    func, path, line = m.groups()
    path = path.replace(root, "")
    if "site-packages/" in path:
        path = path.split("site-packages/", 1)[1]
    return f"{path}:{line} {func}" if line else f"{path} {func}"


def summarize(parsed: dict[str, dict[str, Any]], rate: int, seconds: float) -> list[dict[str, Any]]:
    """One row per thread, busiest first: share of the window, the top frames with their shares."""
    full = rate * seconds
    rows = []
    for name, t in sorted(parsed.items(), key=lambda kv: -kv[1]["samples"]):
        rows.append({"thread": name, "samples": t["samples"], "share": t["samples"] / full,
                     "ours": [(f, n / full) for f, n in t["ours"].most_common(_TOP)],
                     "leaf": [(f, n / full) for f, n in t["leaf"].most_common(_TOP)]})
    return rows


class _Repeat:
    """Runs the same ready prompt through the services again and again on a thread until stopped."""

    def __init__(self, prefill, decode, ids: list[int]):
        self.prefill, self.decode, self.ids = prefill, decode, ids
        self.stop = threading.Event()
        self.bytes = 0
        self.transfer_s = 0.0
        self.count = 0
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            r = run_one(self.prefill, self.decode, f"spy-{self.count}", self.ids, 2)
            self.bytes += r["transfer_bytes"]
            self.transfer_s += r["transfer_s"]
            self.count += 1


def os_thread_cpu(pid: int) -> dict[str, float]:
    """CPU seconds so far of every OS thread of ``pid`` by thread name (digits at the end dropped: a pool is one
    row), from /proc: the threads py-spy cannot see too (gRPC core's, CUDA's, OpenMP's). {} off Linux."""
    out: dict[str, float] = defaultdict(float)
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    for stat in Path(f"/proc/{pid}/task").glob("*/stat"):
        try:
            text = stat.read_text()
        except OSError:  # the thread ended meanwhile
            continue
        name = re.sub(r"[-_]?\d+$", "", text[text.index("(") + 1:text.rindex(")")]) or "?"
        fields = text[text.rindex(")") + 2:].split()
        out[name] += (int(fields[11]) + int(fields[12])) / tick  # utime + stime
    return dict(out)


def cpu_shares(before: dict[str, float], after: dict[str, float], seconds: float) -> list[tuple[str, float]]:
    """Busiest first: each thread name's CPU over the window, as a share of one CPU."""
    shares = [(k, (after[k] - before.get(k, 0.0)) / seconds) for k in after]
    return sorted(((k, v) for k, v in shares if v > 0), key=lambda kv: -kv[1])


def _spy(pids: dict[str, int], seconds: float, rate: int, gil: bool, native: bool, out_dir: Path
         ) -> dict[str, str]:
    """py-spy on every pid at once for ``seconds``; {role: collapsed text}."""
    procs = {}
    for role, pid in pids.items():
        out = out_dir / f"{role}{'-gil' if gil else ''}.txt"
        cmd = ["py-spy", "record", "--pid", str(pid), "--duration", str(int(seconds)), "--rate", str(rate),
               "--threads", "--full-filenames", "--format", "raw", "--output", str(out)]
        cmd += ["--gil"] if gil else []
        cmd += ["--native"] if native else ["--nonblocking"]  # native stacks need the process paused per sample
        procs[role] = (subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True), out)
    texts = {}
    for role, (p, out) in procs.items():
        log, _ = p.communicate(timeout=seconds + 120)
        if p.returncode != 0 or not out.exists():
            raise RuntimeError(f"py-spy on the {role} (pid {pids[role]}) failed ({p.returncode}):\n{log[-2000:]}")
        texts[role] = out.read_text()
    return texts


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser("spy_transfer", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None, help="HF checkpoint (default: bench_transfer's generated one)")
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--length", type=int, default=32768, help="prompt tokens")
    p.add_argument("--kv-dtypes", nargs="+", default=["nvfp4", "fp8_e4m3"])
    p.add_argument("--seconds", type=int, default=6, help="length of each sampling window (whole seconds: py-spy's unit)")
    p.add_argument("--rate", type=int, default=500, help="samples per second")
    p.add_argument("--native", action="store_true",
                   help="native frames too (each sample pauses the process: slower, and it perturbs the transfer)")
    p.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    p.add_argument("--gpu", default="0", help="CUDA_VISIBLE_DEVICES of both services")
    p.add_argument("--grpc-lanes", type=int, default=1,
                   help="the decode's --kv-grpc-lanes (above 1: bench_transfer's grpc-lanes path)")
    p.add_argument("--extra", default="", help="more bench_transfer flags, one string (e.g. '--dtype float32')")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--out-json", default="docs/benchmarks/transfer_spy.json")
    p.add_argument("--out-md", default="docs/benchmarks/transfer_spy.md")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    a = parser.parse_args(argv)
    if a.seconds < 1 or a.rate < 1 or a.length < 1 or a.grpc_lanes < 1:
        parser.error(f"--seconds, --rate, --length and --grpc-lanes must be >= 1, got {a.seconds}, {a.rate}, "
                     f"{a.length}, {a.grpc_lanes}")
    if shutil.which("py-spy") is None:
        print("py-spy is not installed: pip install py-spy", file=sys.stderr)
        return 2
    log_dir = Path(a.log_dir) if a.log_dir else Path(tempfile.mkdtemp(prefix="spy-transfer-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    path = "grpc-lanes" if a.grpc_lanes > 1 else "grpc"
    targs = ["--paths", path, "--grpc-lanes", str(a.grpc_lanes), "--lengths", str(a.length), "--device", a.device, "--prefill-gpu", a.gpu,
             "--decode-gpu", a.gpu, "--kv-dtypes", *a.kv_dtypes, *shlex.split(a.extra)]
    if a.model:
        targs += ["--model", a.model]
    if a.num_layers is not None:
        targs += ["--num-layers", str(a.num_layers)]
    ta = transfer_parser().parse_args(targs)
    model = prepare_model(ta)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    services = start_services(ta, model, log_dir)
    results = []
    try:
        for kv, group in services.items():
            prefill, decode = group["prefill"], group[path]
            ids = [3 + (i * 7919) % (vocab - 3) for i in range(a.length)]
            run_one(prefill, decode, f"warm-{kv}", ids[:ta.warmup_len], 2)
            run_one(prefill, decode, f"first-{kv}", ids, 2)  # computed once: its pages stay in the prefill's cache
            pids = {"prefill": prefill.popen.pid, "decode": decode.popen.pid}
            for mode in ("cpu", "gil"):
                rep = _Repeat(prefill, decode, ids)
                rep.thread.start()
                time.sleep(0.5)
                b0, s0, c0 = rep.bytes, rep.transfer_s, rep.count
                cpu0, t0 = {r: os_thread_cpu(p) for r, p in pids.items()}, time.perf_counter()
                texts = _spy(pids, a.seconds, a.rate, mode == "gil", a.native, log_dir)
                cpu1, window = {r: os_thread_cpu(p) for r, p in pids.items()}, time.perf_counter() - t0
                moved, busy, count = rep.bytes - b0, rep.transfer_s - s0, rep.count - c0
                rep.stop.set()
                rep.thread.join()
                for role, text in texts.items():
                    results.append({"kv_dtype": kv, "mode": mode, "process": role, "transfers": count,
                                    "transfer_gbps": moved / busy / 1e9 if busy > 0 else None,
                                    "os_threads": cpu_shares(cpu0[role], cpu1[role], window)[:12],
                                    "threads": summarize(parse_collapsed(text), a.rate, a.seconds)})
                print(f"{kv} {mode}: {count} transfers, {moved / max(busy, 1e-9) / 1e9:.2f} GB/s while sampled",
                      flush=True)
    finally:
        stop_all(services)
    doc = {"command": invocation("benchmarks.transfer.spy_transfer", argv),
           "length": a.length, "seconds": a.seconds, "rate": a.rate, "native": a.native, "results": results}
    Path(a.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out_json).write_text(json.dumps(doc, indent=1) + "\n")
    Path(a.out_md).write_text(markdown(doc))
    print(markdown(doc))
    return 0


def markdown(doc: dict[str, Any]) -> str:
    lines = [f"# Where the gRPC KV transfer's CPU time goes (py-spy, {doc['length']:,}-token prompt, ready pages)",
             "", f"Command: `{doc['command']}`", "",
             ("cpu: a thread's samples while on a CPU, as a share of the window; gil: while holding the GIL "
             "(shares add up to the GIL's busy share). Frames: the innermost of this repository's code; leaf: "
             "the innermost of any code."), ""]
    for r in doc["results"]:
        gbps = f"{r['transfer_gbps']:.2f} GB/s" if r["transfer_gbps"] else "n/a"
        lines += [f"## {r['kv_dtype']} · {r['process']} · {r['mode']} ({r['transfers']} transfers, {gbps})", "",
                  "| thread | share | top frames of ours (share) | top leaf frames (share) |", "|---|---|---|---|"]
        for t in r["threads"][:10]:
            ours = "<br>".join(f"{f} ({s:.0%})" for f, s in t["ours"][:5])
            leaf = "<br>".join(f"{f} ({s:.0%})" for f, s in t["leaf"][:5])
            lines.append(f"| {t['thread']} | {t['share']:.0%} | {ours} | {leaf} |")
        if r.get("os_threads"):
            lines += ["", "Every OS thread of the process (from /proc, sampling included): "
                      + ", ".join(f"{n} {s:.0%}" for n, s in r["os_threads"]) + "."]
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
