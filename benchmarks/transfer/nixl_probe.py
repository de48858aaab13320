"""Which UCX configuration moves VRAM fastest between two processes of one host, through the nixl path's own
code (``svc_common/kv_transfer_nixl.py``: ``NixlAgent``, ``export_nixl_share``, ``open_nixl_share``,
``read_descs``).

    python -m benchmarks.transfer.nixl_probe [--device cuda|cpu] [--mb 302] [--settings default "UCX_TLS=..." ...]
        [--iters 5] [--timeout-s 60] [--budget-s 240] [--out PATH] [--log-dir DIR]

For each setting (``default``, or space-separated ``KEY=VALUE`` words) it spawns two fresh processes, a target
(the prefill's role: its pool filled with random bytes, exported, its UCX worker progressed) and an initiator
(the decode's role: an empty pool of the same geometry, the share opened). The setting's variables are in the
environment before nixl is loaded (UCX reads it at init; NIXL's own defaults, e.g. UCX_RNDV_THRESH=inf and
UCX_MAX_RMA_RAILS=2, yield to variables already set), and every setting runs with ``UCX_PROTO_INFO=y
UCX_LOG_LEVEL=info`` (a setting may override them). Words ``NIXL_PROBE_*`` are the probe's own, not passed
to UCX:

- ``NIXL_PROBE_OP=WRITE``: the initiator writes its pool into the target's (the push direction) instead of
  reading;
- ``NIXL_PROBE_RUNS=R`` (1): each layer's pages land in R runs of consecutive pages (the destination's blocks
  in reverse order), so a layer is 4R descriptors, as a fragmented pool gives;
- ``NIXL_PROBE_LAYERS=L`` (1): the descriptors of L layers in one xfer (8: one xfer of every layer, as the
  decode batches a run of pages of every layer);
- ``NIXL_PROBE_DESCS=K`` (0, READ only): an xfer split into READs of K descriptors, all posted before any is
  waited for (``NixlAgent.read``'s ``descs_per_read``, as the decode reads);
- ``NIXL_PROBE_POLL_S=S`` (READ only): the interval between two progress-and-check rounds of the READs
  (``NixlAgent.read``'s ``poll_s``; the services' default otherwise);
- ``NIXL_PROBE_BUSY=1``: a second Python thread runs pure-Python work while the initiator transfers, with the
  services' GIL switch interval: the GIL contention a service's event loop gives its copy threads.

A transfer is 8 layers x ``--mb`` bytes in all (302 MB = 2048 pages of the nvfp4 pool
``KVPool("nvfp4", 8, pages, 16, 8, 128)``), by default one xfer per layer of one descriptor per part and run
of consecutive pages (4). After a warm-up (IPC handles opened, protocols selected) it times ``--iters``
transfers, the destination zeroed before each and its checksum compared with the source's after each. Rows:
GB/s (median, best), per-xfer latency, the warm-up transfer, bytes verified, and what UCX selected (the
``ucp_get``/``ucp_put`` protocol tables UCX_PROTO_INFO prints, lanes, warnings), kept in the JSON and in a
side text ``<out>.ucx.txt``; the full logs of both processes go to ``--log-dir``. A setting whose processes
fail, crash or hang gets a row saying so: both are killed at ``--timeout-s`` (and when ``--budget-s`` is spent,
the remaining settings are skipped, so the probe fits its pipeline stage).

Why NIXL READs of VRAM may miss cuda_ipc on one host (UCX 1.23, NIXL 1.5), and the settings that test each:

1. cuda_ipc GET is off without NVLink. cuda_ipc reports ``get.max_zcopy = 0`` when NVML finds no active NVLink
   (``UCX_CUDA_IPC_ENABLE_GET_ZCOPY`` defaults to ``auto``; ucx src/uct/cuda/cuda_ipc/cuda_ipc_iface.c,
   ``uct_cuda_ipc_iface_get_max_get_zcopy``, since openucx/ucx#7566): one H200 with no NVLink peer, or NVML
   queries that fail under gVisor's nvproxy, count as no NVLink. A NIXL READ is a ``ucp_get``: it then falls
   back to software emulation (the target answers with active messages, over tcp (see 3.), and the initiator copies
   each fragment into VRAM with cuda_copy ``put_short``, a cuMemcpyAsync + cuStreamSynchronize per fragment:
   the ``uct_ep_put_short`` of the serving log), while PUT keeps cuda_ipc zero-copy. vllm-project/vllm#52607:
   READ 0.5 GB/s vs WRITE 49 GB/s on a node without NVLink; NIXL turns the option on in its UCX backend after
   1.5 (ai-dynamo/nixl#2208; ai-dynamo/nixl#1097, openucx/ucx#11046). Settings: ``UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y``
   (the fix for READ) and ``NIXL_PROBE_OP=WRITE`` (the push direction, unaffected). The JSON keeps
   ``nvidia-smi nvlink -s``.
2. cuda_ipc is not reachable between the two processes, or cannot use the registered memory.
   ``uct_cuda_ipc_iface_is_reachable_v2`` refuses "same process" and "different PID namespace" peers unless both
   have fabric handles; and a VMM or stream-ordered allocation without fabric handles (e.g. torch's
   ``expandable_segments``, cudaMallocAsync) is registered with a NON_IPC key and cuda_ipc fails at rkey unpack
   (openucx/ucx#10189), so UCX silently takes another lane. Setting: ``UCX_TLS=cuda_ipc,cuda_copy,tcp,self``
   with GET on and ``UCX_LOG_LEVEL=debug`` (the reason is in the log; tcp stays for NIXL's active messages, see
   3.); each process's PID namespace and PYTORCH_CUDA_ALLOC_CONF are in the JSON.
3. The host-staged fallback itself is the slow part, and it runs over tcp: NIXL creates its endpoints with
   ``UCP_ERR_HANDLING_MODE_PEER`` (nixl src/plugins/ucx/ucx_backend.cpp), which the shared-memory transports
   do not support (ucx mm_iface.c clears ERRHANDLE_PEER_FAILURE; a ``UCX_TLS`` of sm without tcp fails agent
   start-up with "no active messages transport ... no peer failure handler", seen on the CPU run), so GET
   emulation sends eager fragments over tcp with a stream sync per fragment. ``UCX_RMA_PPLN_ENABLE=y``
   ("force-enable the RMA rendezvous put/get protocols", ucp_context.c) stages large fragments through
   cuda_copy zero-copy (ai-dynamo/nixl#2039: READ 0.25 -> 3.8 GB/s on its fallback). Settings:
   ``UCX_RMA_PPLN_ENABLE=y UCX_RNDV_THRESH=0`` and ``UCX_TLS=tcp,cuda_copy,self UCX_RMA_PPLN_ENABLE=y``;
   ``UCX_TLS=tcp,cuda_copy`` is the plain host-bounce baseline.
(``UCX_CUDA_IPC_ENABLE_SAME_PROCESS`` does not apply: the two are separate processes. ``UCX_RNDV_THRESH`` governs
tagged/AM rendezvous, not RMA: its row only checks that forcing rendezvous changes nothing.)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import statistics
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch

from engine.kv_pool import KVPool

LAYERS, PAGE_SIZE, KV_HEADS, HEAD_DIM = 8, 16, 8, 128  # the 8-layer Qwen3-8B nvfp4 pool of bench_transfer
BASE_ENV = {"UCX_PROTO_INFO": "y", "UCX_LOG_LEVEL": "info"}
OP_KEY = "NIXL_PROBE_OP"  # the probe's own words, not passed to UCX
RUNS_KEY, LAYERS_KEY, DESCS_KEY, POLL_KEY = "NIXL_PROBE_RUNS", "NIXL_PROBE_LAYERS", "NIXL_PROBE_DESCS", "NIXL_PROBE_POLL_S"
BUSY_KEY = "NIXL_PROBE_BUSY"
PROBE_KEYS = (OP_KEY, RUNS_KEY, LAYERS_KEY, DESCS_KEY, POLL_KEY, BUSY_KEY)
# most telling first: when --budget-s runs out, the last ones are skipped. "default" is what the services run
# (NixlAgent sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y and UCX_CUDA_IPC_MAX_POLL unless the environment says
# otherwise). The fragmented rows read a fragmented pool's pages (4 runs per layer) of every layer in one batch,
# as the decode does: as READs of 32 descriptors, then with a busy Python thread beside them (a service's GIL
# contention), as one READ (how the decode reads now, chosen from these rows), alone and beside the busy
# thread, and as it read before (one READ of 128 descriptors, UCX's MAX_POLL, a 0.2 ms poll), then each change
# alone.
_FRAGMENTED = f"{RUNS_KEY}=4 {LAYERS_KEY}=8"
DEFAULT_SETTINGS = (
    "default",
    f"{_FRAGMENTED} {DESCS_KEY}=32",
    f"{_FRAGMENTED} {DESCS_KEY}=32 {BUSY_KEY}=1",
    f"{_FRAGMENTED}",
    f"{_FRAGMENTED} {BUSY_KEY}=1",
    f"{_FRAGMENTED} UCX_CUDA_IPC_MAX_POLL=16 {POLL_KEY}=0.0002",
    f"{_FRAGMENTED} UCX_CUDA_IPC_MAX_POLL=16 {POLL_KEY}=0.0002 {BUSY_KEY}=1",
    f"{_FRAGMENTED} {POLL_KEY}=0.0002",
    f"{_FRAGMENTED} UCX_CUDA_IPC_MAX_POLL=16",
    f"{_FRAGMENTED} {DESCS_KEY}=8",
    f"{_FRAGMENTED} {DESCS_KEY}=32 UCX_MAX_RMA_RAILS=1",
    f"{RUNS_KEY}=4",
    f"{OP_KEY}=WRITE {_FRAGMENTED}",
    "UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto",
    f"{OP_KEY}=WRITE",
    "UCX_TLS=cuda_ipc,cuda_copy,tcp,self UCX_CUDA_IPC_ENABLE_GET_ZCOPY=y UCX_LOG_LEVEL=debug",
    "UCX_RMA_PPLN_ENABLE=y UCX_RNDV_THRESH=0",
    "UCX_TLS=tcp,cuda_copy",
)
_KEEP = re.compile(r"cuda_ipc|nvlink|cfg#|reachable|WARN|ERROR|Fatal|failed|version", re.IGNORECASE)
_MAX_KEPT, _MAX_OTHER = 100, 40  # UCX lines kept per process and setting; of them, not tables/cfg


def parse_setting(text: str) -> dict[str, str]:
    """``default`` -> {}; else space-separated KEY=VALUE words. Raises ValueError."""
    if text.strip() == "default":
        return {}
    env = {}
    for word in text.split():
        key, sep, value = word.partition("=")
        if not sep or not re.fullmatch(r"[A-Z_][A-Z0-9_]*", key):
            raise ValueError(f"setting {text!r}: {word!r} is not KEY=VALUE (or say 'default')")
        env[key] = value
    op = env.get(OP_KEY, "READ")
    if op not in ("READ", "WRITE"):
        raise ValueError(f"setting {text!r}: {OP_KEY} must be READ or WRITE, not {op!r}")
    for key, lo, hi in ((RUNS_KEY, 1, None), (LAYERS_KEY, 1, LAYERS), (DESCS_KEY, 0, None), (BUSY_KEY, 0, 1)):
        if key in env and not (env[key].isdigit() and lo <= int(env[key]) and (hi is None or int(env[key]) <= hi)):
            raise ValueError(f"setting {text!r}: {key} must be an integer in [{lo}, {hi or 'inf'}], not {env[key]!r}")
    if POLL_KEY in env:
        try:
            ok = float(env[POLL_KEY]) >= 0
        except ValueError:
            ok = False
        if not ok:
            raise ValueError(f"setting {text!r}: {POLL_KEY} must be seconds >= 0, not {env[POLL_KEY]!r}")
    if op == "WRITE" and (DESCS_KEY in env or POLL_KEY in env):
        raise ValueError(f"setting {text!r}: {DESCS_KEY} and {POLL_KEY} apply to READs only")
    return env


def probe_args(env: dict[str, str]) -> dict[str, Any]:
    """The probe words of a parsed setting, with their defaults."""
    from svc_common.kv_transfer_nixl import POLL_S
    return {"op": env.get(OP_KEY, "READ"), "runs": int(env.get(RUNS_KEY, 1)), "layers_per_xfer":
            int(env.get(LAYERS_KEY, 1)), "descs_per_read": int(env.get(DESCS_KEY, 0)),
            "poll_s": float(env.get(POLL_KEY, POLL_S)), "busy": env.get(BUSY_KEY, "0") == "1"}


def page_order(pages: int, runs: int) -> list[int]:
    """Destination page of each source page: ``runs`` blocks of consecutive pages, the blocks in reverse order
    (one run per block)."""
    bounds = [round(i * pages / runs) for i in range(runs + 1)]
    blocks = [list(range(bounds[i], bounds[i + 1])) for i in range(runs)]
    dst = [p for b in reversed(blocks) for p in b]
    order = [0] * pages
    for src, d in zip(range(pages), dst, strict=True):
        order[src] = d
    return order


def pages_for(mb: float) -> int:
    """Pages of the probe pool that hold ``mb`` megabytes over all layers."""
    per_page = KVPool("nvfp4", 1, 1, PAGE_SIZE, KV_HEADS, HEAD_DIM).page_bytes_per_layer * LAYERS
    return max(1, round(mb * 1e6 / per_page))


# -- in the child processes ------------------------------------------------------------------------------
def _tensors(pool: KVPool) -> list[torch.Tensor]:
    return [t.view(torch.uint8).reshape(-1) for lkv in pool.layers for t in (lkv.k, lkv.k_sf, lkv.v, lkv.v_sf)
            if t is not None]


def _fill(pool: KVPool, seed: int) -> None:
    g = torch.Generator(device=pool.device).manual_seed(seed)
    for t in _tensors(pool):
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=pool.device, generator=g))


def _zero(pool: KVPool) -> None:
    for t in _tensors(pool):
        t.zero_()
    if pool.device.type == "cuda":
        torch.cuda.synchronize(pool.device)


def checksum(pool: KVPool, dst_of: list[int] | None = None) -> list[int]:
    """Per tensor: the byte sum and a position-weighted byte sum (catches moved pages), on the pool's device;
    with ``dst_of``, of the pool as its pages would stand after each page ``i`` moved to page ``dst_of[i]``."""
    out = []
    tensors = _tensors(pool)
    if dst_of is not None:  # rows past the allocator's pages (scratch) stay where they are
        rows = pool.layers[0].k.shape[0]
        src_at = torch.arange(rows, dtype=torch.int64)
        src_at[torch.tensor(dst_of)] = torch.arange(len(dst_of))
        src_at = src_at.to(pool.device)
        tensors = [t.view(rows, -1).index_select(0, src_at).reshape(-1) for t in tensors]
    for t in tensors:
        w = (torch.arange(t.numel(), device=t.device, dtype=torch.int64) % 65521 + 1).to(torch.int32)
        out += [int(t.sum(dtype=torch.int64)), int((t.to(torch.int32) * w).sum(dtype=torch.int64))]
    return out


def _sys_info(device: torch.device) -> dict[str, Any]:
    info: dict[str, Any] = {"pid": os.getpid(), "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")}
    try:
        info["pid_ns"] = os.readlink("/proc/self/ns/pid")
    except OSError as e:
        info["pid_ns"] = f"unreadable: {e}"
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    info["ucx_version"] = _ucx_version()
    try:
        from importlib.metadata import version
        info["nixl_version"] = version("nixl")
    except Exception as e:  # noqa: BLE001 - informative only
        info["nixl_version"] = f"unknown ({type(e).__name__})"
    return info


def _ucx_version() -> str:
    """The version of the libucp this process loaded (nixl's bundled one), read through ctypes."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libucp" in line and "/" in line}
        lib = ctypes.CDLL(min(paths))
        lib.ucp_get_version_string.restype = ctypes.c_char_p
        return lib.ucp_get_version_string().decode()
    except Exception as e:  # noqa: BLE001 - informative only
        return f"unknown ({type(e).__name__})"


def _setup(role: str, args: dict):
    from svc_common.kv_transfer_nixl import NixlAgent
    device = torch.device(args["device"], 0) if args["device"] == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    pool = KVPool("nvfp4", LAYERS, args["pages"], PAGE_SIZE, KV_HEADS, HEAD_DIM, device=device)
    agent = NixlAgent(f"probe-{role}-{os.getpid()}", pool)
    return pool, agent, _sys_info(device)


def _run_target(conn, args: dict) -> dict:
    """The prefill's role: export the pool, progress UCX, answer the initiator's zero/sum requests."""
    from svc_common.kv_transfer_nixl import export_nixl_share
    pool, agent, info = _setup("target", args)
    source = args["op"] == "READ"
    if source:
        _fill(pool, seed=1)
    else:
        _zero(pool)
    share = export_nixl_share(pool, agent)
    dst_of = page_order(args["pages"], args["runs"])
    conn.send({"share": share.SerializeToString(), "sums": checksum(pool, dst_of) if source else None})
    agent.serve_begin()
    try:
        while True:
            msg = conn.recv()  # EOFError once the initiator is gone
            if msg == "zero":
                _zero(pool)
                conn.send("ok")
            elif msg == "sum":
                conn.send(checksum(pool))
            else:
                return {"sys": info}
    finally:
        agent.serve_end()


def _xfer(agent, args: dict, remote: str, local, remote_descs, mem_type: str, timeout_s: float) -> int:
    """One xfer of ``args['op']``: READ through ``NixlAgent.read`` (the decode's code, with the setting's split
    and poll interval); WRITE, which the project's wrapper does not offer, through the same raw nixl_agent calls.
    Returns the READ's rounds of state checks (0 for a WRITE)."""
    if args["op"] == "READ":
        return agent.read(remote, local, remote_descs, mem_type, timeout_s, threading.Event(),
                          descs_per_read=args["descs_per_read"], poll_s=args["poll_s"])
    a = agent.agent
    handle = a.initialize_xfer("WRITE", a.get_xfer_descs(local, agent.mem_type),
                               a.get_xfer_descs(remote_descs, mem_type), remote)
    try:
        state, deadline = a.transfer(handle), time.monotonic() + timeout_s
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(0.0002)
            state = a.check_xfer_state(handle)
        if state != "DONE":
            raise RuntimeError(f"NIXL WRITE ended in state {state}")
    finally:
        agent._release(handle)
    return 0


def _busy(stop) -> None:
    """Pure-Python work until ``stop`` is set (holds the GIL between switch intervals)."""
    x = 0
    while not stop.is_set():
        for i in range(2000):
            x ^= i


def xfer_descs(pool: KVPool, view, device_id: int, args: dict) -> list:
    """(local, remote) descriptor rows of each xfer: ``layers_per_xfer`` layers each, every page of a layer
    moved to ``page_order``'s place (READ: remote page i into local page order[i]; WRITE: local i into remote
    order[i])."""
    import numpy as np

    from svc_common.kv_transfer_nixl import read_descs
    src, dst = list(range(args["pages"])), page_order(args["pages"], args["runs"])
    per_layer = [read_descs(pool, view, [layer], src, dst, device_id) if args["op"] == "READ" else
                 read_descs(pool, view, [layer], dst, src, device_id) for layer in range(LAYERS)]
    step = args["layers_per_xfer"]
    return [tuple(np.concatenate([d[i] for d in per_layer[b:b + step]]) for i in (0, 1))
            for b in range(0, LAYERS, step)]


def _run_initiator(conn, args: dict) -> dict:
    """The decode's role: open the target's share and time transfers of every page of every layer."""
    from nvfp4_serve_proto import prefill_pb2
    from svc_common.kv_transfer_nixl import open_nixl_share
    pool, agent, info = _setup("initiator", args)
    first = conn.recv()
    op = args["op"]
    if op == "WRITE":
        _fill(pool, seed=1)
        want = checksum(pool, page_order(args["pages"], args["runs"]))
    else:
        _zero(pool)
        want = first["sums"]
    view = open_nixl_share(prefill_pb2.KVShare.FromString(first["share"]), pool, agent)
    descs = xfer_descs(pool, view, agent.device_id, args)
    row: dict[str, Any] = {"sys": info, "descs_per_xfer": len(descs[0][0]), "transfer_ms": [], "xfer_ms": [],
                           "warmup_ms": [], "verified": [], "rounds": []}
    stop_busy = threading.Event()
    if args["busy"]:
        from engine.engine_loop import favour_engine_thread
        favour_engine_thread()
        threading.Thread(target=_busy, args=(stop_busy,), daemon=True).start()
    for i in range(args["warmup"] + args["iters"]):
        if op == "READ":
            _zero(pool)
        else:
            conn.send("zero")
            conn.recv()
        lat = []
        t0 = time.perf_counter()
        for local, remote in descs:
            t1 = time.perf_counter()
            rounds = _xfer(agent, args, view.remote, local, remote, view.mem_type, args["xfer_timeout_s"])
            lat.append((time.perf_counter() - t1) * 1e3)
            if i >= args["warmup"]:
                row["rounds"].append(rounds)
        ms = (time.perf_counter() - t0) * 1e3
        if op == "READ":
            got = checksum(pool)
        else:
            conn.send("sum")
            got = conn.recv()
        if i < args["warmup"]:
            row["warmup_ms"].append(round(ms, 3))
        else:
            row["transfer_ms"].append(round(ms, 3))
            row["xfer_ms"] += [round(x, 3) for x in lat]
        row["verified"].append(got == want)
    stop_busy.set()
    conn.send("done")
    return row


def _child(role: str, env: dict[str, str], args: dict, peer, result, log_path: str) -> None:
    """Entry of a spawned child: log to ``log_path`` (UCX writes to fd 1/2), apply ``env``, then run."""
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    for key in [k for k in os.environ if k.startswith("UCX_")]:
        del os.environ[key]
    os.environ.update(env)
    try:
        out = (_run_target if role == "target" else _run_initiator)(peer, args)
    except BaseException as e:  # noqa: BLE001 - reported as the row's error, the process then exits
        traceback.print_exc()
        out = {"error": f"{role}: {type(e).__name__}: {str(e)[:400]}"}
    sys.stdout.flush()
    result.send(out)


# -- in the parent ---------------------------------------------------------------------------------------
_PREFIX = re.compile(r"^\[[^\]]*\]\s*\[[^\]]*\]\s*")  # UCX's "[time] [host:pid:thread]"


def ucx_lines(text: str) -> list[str]:
    """What UCX said it selected: the protocol tables of remote memory reads/writes between the two processes
    (ucp_get/ucp_put, printed by UCX_PROTO_INFO; loopback "self" tables dropped), lane configurations (cfg#),
    and cuda_ipc / NVLink / warning / error lines."""
    kept: list[str] = []  # tables and lane configurations first: a debug log's other lines must not crowd them out
    other: list[str] = []
    table: list[str] = []

    def flush(lines: list[str]) -> None:
        body = " ".join(lines)
        if re.search(r"ucp_get|ucp_put", body) and " self cfg#" not in body:
            kept.extend(lines)

    for line in [*text.splitlines(), ""]:
        s = _PREFIX.sub("", line.strip())
        if s.startswith("|") and "cfg#" in s and table:  # a table's name row: the line before is its top border
            flush(table[:-1])
            table = table[-1:]
        if s.startswith(("|", "+")):
            table.append(s)
            continue
        flush(table)
        table = []
        if _KEEP.search(s) and "UCX" in s:
            (kept if "cfg#" in s else other).append(s[:240])
    return (kept + other[:_MAX_OTHER])[:_MAX_KEPT]


def selected(lines: list[str]) -> str:
    """A short summary of the rows (``| range | protocol | lanes |``) of the get/put tables in ``lines``."""
    seen: list[str] = []
    op = ""
    for s in lines:
        if "ucp_get" in s or "ucp_put" in s:
            op = "get" if "ucp_get" in s else "put"
            mem = re.search(r"(into|from) (\S+)", s)
            op += f"({mem.group(2)})" if mem else ""
        cells = [c.strip() for c in s.strip("|").split("|")]
        if op and s.startswith("|") and len(cells) >= 3 and re.match(r"^\d+[KMGT]?(\.\.|$)", cells[0]):
            item = f"{op} {cells[0]}: {cells[1]} [{cells[2]}]"
            if item not in seen:
                seen.append(item)
    return "; ".join(seen)


def _child_env(setting: dict[str, str]) -> dict[str, str]:
    """The child's UCX variables: BASE_ENV, then the setting's (``_child`` drops inherited UCX_* first)."""
    return BASE_ENV | {k: v for k, v in setting.items() if k not in PROBE_KEYS}


def _collect(procs: dict, results: dict, timeout_s: float) -> tuple[dict, str]:
    """Each child's result dict, waited for up to ``timeout_s`` in all; then every child is killed.
    Returns (results by role, '' or why some did not answer)."""
    got, why, deadline = {}, "", time.monotonic() + timeout_s
    try:
        while len(got) < len(procs):
            for role, conn in results.items():
                if role not in got and conn.poll(0.05):
                    got[role] = conn.recv()
            for role, p in procs.items():
                if role not in got and not p.is_alive() and not results[role].poll(0):
                    why = why or f"{role} exited with status {p.exitcode} without a result"
                    got[role] = {}
            if time.monotonic() > deadline:
                why = why or f"no result within {timeout_s:.0f} s (hang); killed"
                break
    finally:
        for p in procs.values():
            p.join(2.0)
            if p.is_alive():
                p.kill()
                p.join(5.0)
    return got, why


def run_setting(text: str, args, log_dir: Path, timeout_s: float) -> dict[str, Any]:
    """One row: ``text``'s two fresh processes, a warm-up and ``args.iters`` timed transfers."""
    setting = parse_setting(text)
    words = probe_args(setting)
    op = words["op"]
    child_args = {"device": args.device, "pages": args.pages, "warmup": args.warmup, "iters": args.iters,
                  "xfer_timeout_s": max(1.0, timeout_s / 2), **words}
    env = _child_env(setting)
    ctx = mp.get_context("spawn")
    peer_t, peer_i = ctx.Pipe()
    procs, results, logs = {}, {}, {}
    for role, peer in (("target", peer_t), ("initiator", peer_i)):
        recv, send = ctx.Pipe(duplex=False)
        logs[role] = log_dir / f"{_slug(text)}.{role}.log"
        procs[role] = ctx.Process(target=_child, args=(role, env, child_args, peer, send, str(logs[role])),
                                  name=f"nixl-probe-{role}", daemon=True)
        procs[role].start()
        send.close()
        results[role] = recv
    peer_t.close()
    peer_i.close()  # the children hold the only ends: one's death is the other's EOF
    got, why = _collect(procs, results, timeout_s)
    return _row(text, op, setting, args, got, why, logs)


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9]+", "_", text).strip("_")[:80] or "default"


def _row(text: str, op: str, setting: dict, args, got: dict, why: str, logs: dict) -> dict[str, Any]:
    ini, tgt = got.get("initiator", {}), got.get("target", {})
    lines = {role: ucx_lines(p.read_text(errors="replace")) if p.exists() else [] for role, p in logs.items()}
    nbytes = args.pages * LAYERS * KVPool("nvfp4", 1, 1, PAGE_SIZE, KV_HEADS, HEAD_DIM).page_bytes_per_layer
    row: dict[str, Any] = {"setting": text, "env": setting, "op": op, "bytes": nbytes,
                           "error": ini.get("error") or tgt.get("error") or why,
                           "selected": selected(lines["initiator"]) or selected(lines["target"]),
                           "sys": {"initiator": ini.get("sys"), "target": tgt.get("sys")},
                           "ucx_lines": lines, "logs": {k: str(v) for k, v in logs.items()}}
    ms = ini.get("transfer_ms") or []
    if ms:
        row.update(gbps=round(nbytes / statistics.median(ms) / 1e6, 3), gbps_best=round(nbytes / min(ms) / 1e6, 3),
                   transfer_ms=ms, xfer_ms=ini["xfer_ms"], xfer_ms_median=round(statistics.median(ini["xfer_ms"]), 3),
                   xfer_ms_max=max(ini["xfer_ms"]), warmup_ms=ini["warmup_ms"],
                   descs_per_xfer=ini["descs_per_xfer"], rounds=ini["rounds"], verified=all(ini["verified"]),
                   verified_each=ini["verified"])
    row["status"] = "ok" if ms and row["verified"] and not row["error"] else (
        "WRONG BYTES" if ms and not row["verified"] else f"failed: {row['error'] or 'no timings'}")
    return row


def nvlink_status() -> str:
    """``nvidia-smi nvlink -s`` (what NVML says about NVLink: cause 1 of the module docstring), trimmed."""
    if shutil.which("nvidia-smi") is None:
        return "nvidia-smi not found"
    try:
        p = subprocess.run(["nvidia-smi", "nvlink", "-s"], capture_output=True, text=True, timeout=20, check=False)
        return (p.stdout + p.stderr).strip()[:2000] or f"(no output, status {p.returncode})"
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"nvidia-smi nvlink -s failed: {type(e).__name__}: {e}"


def table(rows: list[dict]) -> str:
    head = f"{'setting':<72} {'op':<5} {'GB/s':>8} {'best':>8} {'xfer ms':>8} {'warm ms':>8}  ok  status / selected"
    out = [head, "-" * len(head)]
    for r in rows:
        nums = (f"{r['gbps']:>8.2f} {r['gbps_best']:>8.2f} {r['xfer_ms_median']:>8.2f} {r['warmup_ms'][0]:>8.1f}"
                if "gbps" in r else f"{'-':>8} {'-':>8} {'-':>8} {'-':>8}")
        ok = {True: "yes", False: "NO"}.get(r.get("verified"), " - ")
        tail = r["selected"] if r["status"] == "ok" else f"{r['status'][:120]} | {r['selected']}"
        out.append(f"{r['setting'][:72]:<72} {r['op']:<5} {nums}  {ok:<3} {tail[:200]}")
    return "\n".join(out)


def side_text(report: dict) -> str:
    parts = [f"nixl_probe {report['date']} device={report['device']} bytes={report['bytes']}",
             f"nvidia-smi nvlink -s:\n{report['nvlink']}", ""]
    for r in report["rows"]:
        parts.append(f"=== {r['setting']} ({r['op']}): {r['status']}  {r.get('gbps', '-')} GB/s")
        for role in ("initiator", "target"):
            parts.append(f"--- {role} (sys {r['sys'][role]})")
            parts += r["ucx_lines"][role] or ["(no UCX lines)"]
        parts.append("")
    return "\n".join(parts)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--mb", type=float, default=302.0, help="bytes per transfer, all layers (302 = 2048 pages)")
    ap.add_argument("--settings", nargs="+", default=list(DEFAULT_SETTINGS),
                    help="'default' or space-separated KEY=VALUE words, one setting per argument")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--timeout-s", type=float, default=60.0, help="per setting; its processes are killed then")
    ap.add_argument("--budget-s", type=float, default=240.0, help="all settings; later ones are skipped")
    ap.add_argument("--out", default=None, help="JSON (default docs/benchmarks/nixl_probe.json on cuda, "
                                                "/tmp/nixl_probe_cpu.json on cpu); side text <out>.ucx.txt")
    ap.add_argument("--log-dir", default="/tmp/nixl_probe_logs")
    args = ap.parse_args(argv)
    for s in args.settings:
        try:
            parse_setting(s)
        except ValueError as e:
            ap.error(str(e))
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda needs a GPU (use --device cpu for the DRAM smoke run)")
    args.pages = pages_for(args.mb)
    out = Path(args.out or ("docs/benchmarks/nixl_probe.json" if args.device == "cuda" else "/tmp/nixl_probe_cpu.json"))
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    report = run_all(args, log_dir)
    print(table(report["rows"]))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    out.with_suffix(".ucx.txt").write_text(side_text(report) + "\n")
    print(f"wrote {out} and {out.with_suffix('.ucx.txt')}; full UCX logs in {log_dir}")


def run_all(args, log_dir: Path) -> dict[str, Any]:
    t_end = time.monotonic() + args.budget_s
    rows = []
    for text in args.settings:
        left = t_end - time.monotonic()
        if left < 10:
            rows.append({"setting": text, "op": parse_setting(text).get(OP_KEY, "READ"), "selected": "",
                         "status": "skipped: the probe's --budget-s is spent", "sys": {}, "ucx_lines": {}})
            continue
        print(f"-- {text}", flush=True)
        rows.append(run_setting(text, args, log_dir, min(args.timeout_s, left)))
        print(f"   {rows[-1]['status']} {rows[-1].get('gbps', '-')} GB/s  {rows[-1]['selected'][:160]}", flush=True)
    return {"date": time.strftime("%Y-%m-%d %H:%M:%S"), "device": args.device,
            "gpu": torch.cuda.get_device_name(0) if args.device == "cuda" else "",
            "pages": args.pages, "layers": LAYERS, "bytes": rows and rows[0].get("bytes"),
            "warmup": args.warmup, "iters": args.iters, "base_env": BASE_ENV,
            "inherited_ucx_env_cleared": sorted(k for k in os.environ if k.startswith("UCX_")),
            "nvlink": nvlink_status() if args.device == "cuda" else "(cpu run)", "rows": rows}


if __name__ == "__main__":
    main()
