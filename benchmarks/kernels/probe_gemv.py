"""Our skinny linear (``nvfp4_kernels/skinny_linear.py``) against cuBLAS (``F.linear``) on the decode step's
projections (development probe): each checked against the fp32 product, then 36 calls in a row (one per layer,
each on its own copy of the weight, so no call finds its weight in L2 from the call before) captured as one CUDA
graph and timed, as the step replays them; TB/s = weight bytes / time per call.

    python -m benchmarks.kernels.probe_gemv [--rows 1 16 44] [--configs 32:256:1:3 ...] [--out F]
    python -m benchmarks.kernels.probe_gemv --compile-only    # no GPU: registers and spills per config, sm_90a

A config is BLOCK_N:BLOCK_K:SPLIT_K:NUM_STAGES (4 warps); each runs without programmatic dependent launch, with
it, and with it and its first two weight blocks sent towards L2 before it waits on the call ahead. The gate-up
projection also runs as the MLP's whole input side: cuBLAS then silu_mul against the gated skinny launch.
"""

from __future__ import annotations

import argparse
import json
import sys

import torch

# Qwen3-8B: (name, N, K)
PROJECTIONS = (("qkv", 6144, 4096), ("o", 4096, 4096), ("gate_up", 24576, 4096), ("down", 4096, 12288))
CONFIGS = ("16:256:1:3", "32:128:1:4", "64:128:1:3", "32:256:2:3")
# (programmatic dependent launch, weight blocks prefetched to L2 before the wait)
VARIANTS = ((False, 0), (True, 0), (True, 2))
LAYERS = 36


def parse_config(text: str) -> dict:
    block_n, block_k, split_k, stages = (int(v) for v in text.split(":"))
    return {"block_n": block_n, "block_k": block_k, "split_k": split_k, "num_stages": stages}


def compile_report(cfg: dict, rows: int = 16, gated: bool = False) -> dict:
    """The kernel (``gated``: its merged gate-up form) compiled for sm_90a with Triton's bundled ptxas (no GPU):
    registers and spills."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from benchmarks.kernels.probe_tma import sass_report
    from nvfp4_kernels.triton.skinny_linear import skinny_linear_kernel

    sig = {"X": "*bf16", "W": "*bf16", "Y": "*bf16" if cfg["split_k"] == 1 else "*fp32", "M": "i32", "N": "i32",
           "K": "i32", "k_span": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_ym": "i32"}
    cx = {"BLOCK_M": max(16, triton.next_power_of_2(rows)), "BLOCK_N": cfg["block_n"], "BLOCK_K": cfg["block_k"],
          "SPLIT_K": cfg["split_k"], "PDL": True, "PREFETCH": 2, "BF16_DOT": True, "GATED": gated}
    # what the launcher specializes at run time (pointers and ints divisible by 16): 16-byte cp.async loads
    aligned = ("X", "W", "Y", "K", "k_span", "stride_xm", "stride_wn", "stride_ym")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(sig) if n in aligned}
    src = ASTSource(fn=skinny_linear_kernel, signature=dict(sig, **{k: "constexpr" for k in cx}), constexprs=cx,
                    attrs=attrs)
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": 4, "num_stages": cfg["num_stages"]})
    rep = sass_report(kernel)
    return {"registers": rep["registers"], "spills": rep["spills"]}


def _graph_ms(fn, calls: int = LAYERS, samples: int = 20) -> float:
    """ms per call of ``fn(0) ... fn(calls - 1)`` captured as one CUDA graph (median of ``samples`` replays)."""
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        for i in range(2):
            fn(i)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for i in range(calls):
            fn(i)
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return sorted(times)[len(times) // 2]


def measure(rows: list[int], configs: list[str], dev: torch.device) -> list[dict]:
    import torch.nn.functional as F

    from nvfp4_kernels.skinny_linear import SkinnyConfig, skinny_linear

    out = []
    for name, n, k in PROJECTIONS:
        w = (torch.randn(n, k, device=dev) * 0.02).to(torch.bfloat16)
        ws = [w] + [w.clone() for _ in range(LAYERS - 1)]  # one per layer: L2 (50-60 MB) holds none of them
        wbytes = w.numel() * w.element_size()
        for m in rows:
            x = torch.randn(m, k, device=dev).to(torch.bfloat16)
            ref = x.float() @ w.float().t()
            base = {"projection": name, "n": n, "k": k, "rows": m, "weight_mb": wbytes / 1e6}
            ms = _graph_ms(lambda i, x=x, ws=ws: F.linear(x, ws[i]))
            out.append({**base, "kernel": "cublas", "ms": ms, "tb_s": wbytes / ms / 1e9})
            for text in configs:
                cfg = parse_config(text)
                for pdl, prefetch in VARIANTS:
                    label = f"skinny {text}" + (" pdl" if pdl else "") + (f" pf{prefetch}" if prefetch else "")
                    row = {**base, "kernel": label, **cfg, "pdl": pdl, "prefetch": prefetch}
                    out.append(_checked_and_timed(
                        row, ref, wbytes, lambda i, x=x, ws=ws, pdl=pdl, prefetch=prefetch, cfg=cfg:
                        skinny_linear(x, ws[i], SkinnyConfig(**cfg), pdl=pdl, prefetch=prefetch)))
            if name == "gate_up":
                out += _gated_rows(base, x, ws, configs, wbytes)
    return out


def _gated_rows(base: dict, x: torch.Tensor, ws: list[torch.Tensor], configs: list[str], wbytes: int) -> list[dict]:
    """The MLP's input side as the engine can run it: cuBLAS then ``silu_mul`` (two launches) against the skinny
    linear's gated form (one launch, PDL), each split_k-1 config; checked against silu_mul of the fp32 product."""
    import torch.nn.functional as F

    from nvfp4_kernels.fused_ops import silu_mul
    from nvfp4_kernels.skinny_linear import SkinnyConfig, skinny_linear

    ref = silu_mul((x.float() @ ws[0].float().t()).to(x.dtype)).float()
    ms = _graph_ms(lambda i: silu_mul(F.linear(x, ws[i])))
    out = [{**base, "kernel": "cublas + silu_mul", "ms": ms, "tb_s": wbytes / ms / 1e9}]
    for text in configs:
        cfg = parse_config(text)
        if cfg["split_k"] != 1:
            continue
        row = {**base, "kernel": f"gated {text} pdl", **cfg, "pdl": True, "prefetch": 0}
        out.append(_checked_and_timed(row, ref, wbytes, lambda i, cfg=cfg: skinny_linear(
            x, ws[i], SkinnyConfig(**cfg), pdl=True, gated=True)))
    return out


def _checked_and_timed(row: dict, ref: torch.Tensor, wbytes: int, call) -> dict:
    """``row`` with ``call(0)`` checked against ``ref`` (relative error < 1e-2), then ``call(i)`` timed as 36 calls
    of one graph: ms and TB/s, or the error that stopped it (recorded: the other configs go on). Printed."""
    try:
        y = call(0).float()
        err = float((y - ref).abs().max() / ref.abs().max())
        if not err < 1e-2:
            raise AssertionError(f"relative error {err:.2e}")
        row["ms"] = _graph_ms(call)
        row["tb_s"] = wbytes / row["ms"] / 1e9
    except Exception as e:  # noqa: BLE001 - recorded, the other configs go on
        row["error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(row), file=sys.stderr, flush=True)
    return row


def print_table(rows: list[dict], copy_tbs: float) -> None:
    print(f"{'proj':>8} {'M':>3} {'kernel':>24} {'us/call':>8} {'TB/s':>6} {'of copy':>7}")
    for r in rows:
        if "error" in r:
            print(f"{r['projection']:>8} {r['rows']:>3} {r['kernel']:>24}  {r['error'][:60]}")
        else:
            print(f"{r['projection']:>8} {r['rows']:>3} {r['kernel']:>24} {r['ms'] * 1e3:8.1f} {r['tb_s']:6.2f} "
                  f"{r['tb_s'] / copy_tbs:7.0%}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rows", nargs="+", type=int, default=[1, 16, 44])
    p.add_argument("--configs", nargs="+", default=list(CONFIGS))
    p.add_argument("--compile-only", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    for text in a.configs:
        try:
            parse_config(text)
        except ValueError:
            p.error(f"--configs: {text!r} is not BLOCK_N:BLOCK_K:SPLIT_K:NUM_STAGES")
    if any(not 1 <= m <= 64 for m in a.rows):
        p.error("--rows: 1..64")
    if a.compile_only:
        for text in a.configs:
            print(text, json.dumps(compile_report(parse_config(text), max(a.rows))))
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("probe_gemv needs a CUDA GPU (or --compile-only)")
    from benchmarks.kernels.bench_decode import copy_bandwidth
    from benchmarks.kernels.probe_gluon import write_json

    dev = torch.device("cuda")
    bw = copy_bandwidth(dev)
    rows = measure(a.rows, a.configs, dev)
    print_table(rows, bw)
    write_json(a.out, bw, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
