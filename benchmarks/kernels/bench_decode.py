"""Kernel benchmark: check every GPU kernel against the reference, then time NVFP4 decode vs FlashInfer.

    python -m benchmarks.kernels.bench_decode [--out docs/benchmarks/kernels.json] [--sweep] [--quick]
        [--md docs/benchmarks/kernels.md]

Needs CUDA (and flashinfer for the baselines; without it only our kernels are timed). GQA 32/8, head_dim
128, page 16, one layer. Prints a table of microseconds, achieved TB/s (each format's own K+V bytes:
codes and block scales for NVFP4) and speedups, plus the quantize kernel's bandwidth, and writes JSON; with
``--md``, the table of the GPU's default kernel (the one the engine runs) replaces the generated part of that
markdown file (between its ``<!-- bench_decode -->`` markers).
Timings are CUDA-event medians (triton.testing.do_bench) twice over: calls launched one after another from
Python (``us``), and the same calls replayed from one CUDA graph (``graph_us``: how the engine's decode step runs
them; at short contexts the eager figure times the host's launches, not the kernels). Shapes whose pool is smaller
than 4x L2 rotate through disjoint copies of the pages so the cache never holds them.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import sys
import time
import traceback
from dataclasses import asdict

import torch

PAGE, HK, HQ, D = 16, 8, 32, 128
SHAPES = ((44, 32768), (84, 32768), (10, 163840), (1, 1048576), (128, 4096), (1, 32768))
SM_SCALE = 1.0 / math.sqrt(D)
K_G, V_G = 0.05, 0.03  # NVFP4 global scales used for the timing pools


def _log(msg: str) -> None:
    print(msg, flush=True)


def _bench(fn, rep_ms: int = 200) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=25, rep=rep_ms, return_mode="median") * 1e3  # us


def _bench_graph(fns: list, eager_us: float) -> float:
    """Microseconds per call with the calls replayed from one CUDA graph (as the engine's decode step runs them:
    no host launch work between kernels). ``fns`` rotate over copies of the pages; short calls are captured
    several times over so one replay lasts long enough to time."""
    calls = len(fns) * max(1, math.ceil(16 / len(fns))) if eager_us < 200 else len(fns)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fns[i % len(fns)]()
    us = _bench(graph.replay) / calls
    del graph
    return us


def nvfp4_bytes(batch: int, seq_len: int) -> int:
    return batch * seq_len * HK * 2 * (D // 2 + D // 16)


def copy_bandwidth(dev: torch.device) -> float:
    """Device-to-device copy, bytes read + written per second (TB/s)."""
    x = torch.empty(2 * 1024**3, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    us = _bench(functools.partial(y.copy_, x), 300)
    return 2 * 2 * 1024**3 / us / 1e6


# -- correctness ---------------------------------------------------------------------------------------
def run_checks(dev: torch.device) -> dict:
    """Every kernel vs the reference: bit-exact bytes for quantize / workspace, rel. error for decode."""
    from nvfp4_kernels import fp8, nvfp4
    from nvfp4_kernels.backends.triton_backend import (
        DecodeConfig,
        DecodeKernel,
        TritonBackend,
        dequant_rows_to_fp8,
        quantize_rows,
    )
    from nvfp4_kernels.kv_layout import LayerKV

    out: dict = {}
    torch.manual_seed(0)
    tb = TritonBackend()
    for hk, d, dt in ((8, 128, torch.bfloat16), (3, 64, torch.float32), (2, 256, torch.float16)):
        t = 3001
        x = torch.randn(t, hk, d, device=dev) * torch.exp(torch.randn(t, hk, d, device=dev) * 2)
        x = x.clamp(-6e4, 6e4).to(dt)
        x[0] = 0
        x[1, :, :16] = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0, -0.25, -0.75, -5, 7, 0.1, -0.1, 0, -0.0])
        slots = torch.randperm(t + 13, device=dev)[:t]
        data = torch.zeros(t + 13, hk, d // 2, dtype=torch.uint8, device=dev)
        sf = torch.zeros(t + 13, hk, d // 16, dtype=torch.uint8, device=dev)
        quantize_rows(x, slots, data, sf, K_G)
        rd, rs = nvfp4.quantize(x, K_G)
        ws = torch.zeros(t, hk, d, dtype=torch.float8_e4m3fn, device=dev)
        dequant_rows_to_fp8(data, sf, slots, ws, K_G, 0.0123)
        rws = fp8.quantize(nvfp4.dequantize(rd, rs, K_G), 0.0123)
        key = f"quantize_{dt}_D{d}"
        out[key] = {"data_mismatch": int((data[slots] != rd).sum()), "scale_mismatch": int((sf[slots] != rs.view(torch.uint8)).sum()),
                        "workspace_mismatch": int((ws.view(torch.uint8) != rws.view(torch.uint8)).sum())}
        _log(f"check {key}: {out[key]}")

    for g, d, lens in ((1, 128, (5000, 17, 1)), (4, 128, (3001, 640, 33)), (8, 64, (2049, 100)), (4, 256, (1500, 16))):
        b, hq = len(lens), HK * g
        maxp = max(-(-n // PAGE) for n in lens) + 1
        p = b * maxp + 5
        layer = LayerKV("nvfp4", PAGE, HK, d, torch.zeros(p, PAGE, HK, d // 2, dtype=torch.uint8, device=dev),
                        torch.zeros(p, PAGE, HK, d // 2, dtype=torch.uint8, device=dev),
                        torch.zeros(p, PAGE, HK, d // 16, dtype=torch.float8_e4m3fn, device=dev),
                        torch.zeros(p, PAGE, HK, d // 16, dtype=torch.float8_e4m3fn, device=dev), K_G, V_G)
        kk = torch.randn(p * PAGE, HK, d, device=dev)
        kk[:, :, 7] *= 40.0  # outlier channel
        tb.write_kv(layer, torch.arange(p * PAGE, device=dev), kk, torch.randn(p * PAGE, HK, d, device=dev))
        pt = torch.randperm(p, device=dev)[: b * maxp].reshape(b, maxp).to(torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32, device=dev)
        q = torch.randn(b, hq, d, device=dev).to(torch.bfloat16)
        ours = tb.decode(tb.plan_decode(pt, seq, hq, HK, d, PAGE), q, layer, 1 / math.sqrt(d)).float()
        ref = fp32_decode_reference(layer, pt, seq, q, 1 / math.sqrt(d))
        err = float((ours - ref).norm() / ref.norm())
        key = f"decode_G{g}_D{d}_lens{'-'.join(map(str, lens))}"
        out[key] = {"rel_err": err, "splits": tb.plan_decode(pt, seq, hq, HK, d, PAGE).backend_state.num_splits}
        for kernel in (DecodeKernel.GLUON, DecodeKernel.GLUON_TMA):  # many splits: split edges, empty splits
            gb = TritonBackend(DecodeConfig(1, 32, 3, 64, kernel))
            gl_out = gb.decode(gb.plan_decode(pt, seq, hq, HK, d, PAGE), q, layer, 1 / math.sqrt(d)).float()
            out[key][f"{kernel.value}_rel_err"] = float((gl_out - ref).norm() / ref.norm())
        _log(f"check {key}: rel err {err:.2e}, gluon {out[key]['gluon_rel_err']:.2e}, "
             f"gluon-tma {out[key]['gluon-tma_rel_err']:.2e}")

    try:
        from nvfp4_kernels.backends.flashinfer_backend import flashinfer_available, nvfp4_dequantize_rows

        if flashinfer_available():
            x = torch.randn(8192, D, device=dev) * 3
            rows, sc = torch.zeros(8192, D // 2, dtype=torch.uint8, device=dev), torch.zeros(8192, D // 16, dtype=torch.uint8, device=dev)
            quantize_rows(x[:, None], torch.arange(8192, device=dev), rows[:, None], sc[:, None], K_G)
            fi = nvfp4_dequantize_rows(rows, sc, K_G)
            ref = nvfp4.dequantize(rows, sc, K_G).to(torch.bfloat16).float()
            out["flashinfer_reads_our_pages_max_abs_diff"] = float((fi - ref).abs().max())
            _log(f"check FlashInfer nvfp4_kv_dequantize on our quantize-kernel pages: max abs diff "
                 f"{out['flashinfer_reads_our_pages_max_abs_diff']}")
            out["flashinfer_writes_nvfp4"] = "not on SM90: flashinfer.nvfp4_kv_quantize requires SM100+"
    except Exception:  # noqa: BLE001 - a failed optional check is reported, not fatal
        out["flashinfer_format_check"] = "failed: " + traceback.format_exc()[-500:]
        _log(out["flashinfer_format_check"])
    return out


def fp32_decode_reference(layer, page_table, seq_lens, q, sm_scale) -> torch.Tensor:
    """softmax(q . K^T * sm_scale) . V in fp32 over the dequantized pages (no output rounding)."""
    from nvfp4_kernels import nvfp4

    s = layer.page_size
    group = q.shape[1] // layer.num_kv_heads
    outs = []
    for b, n in enumerate(seq_lens.tolist()):
        pages = page_table[b, : -(-n // s)].long()
        k = nvfp4.dequantize(layer.k[pages], layer.k_sf[pages], layer.k_scale).flatten(0, 1)[:n]
        v = nvfp4.dequantize(layer.v[pages], layer.v_sf[pages], layer.v_scale).flatten(0, 1)[:n]
        k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)  # [n, Hq, D]
        p = torch.softmax(torch.einsum("hd,nhd->hn", q[b].float(), k) * sm_scale, dim=-1)
        outs.append(torch.einsum("hn,nhd->hd", p, v))
    return torch.stack(outs)


# -- timing --------------------------------------------------------------------------------------------
def _rotations(nbytes: int) -> int:
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    return 1 if nbytes >= 4 * l2 else min(16, math.ceil(4 * l2 / nbytes))


def _nvfp4_pool(dev, batch, seq_len, rot, layout="NHD"):
    from nvfp4_kernels.kv_layout import LayerKV

    pages = batch * seq_len // PAGE
    total = pages * rot
    shape = (total, PAGE, HK, D // 2) if layout == "NHD" else (total, HK, PAGE, D // 2)
    sshape = shape[:-1] + (D // 16,)
    k = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev)
    v = torch.randint(0, 256, shape, dtype=torch.uint8, device=dev)
    ks = torch.randint(0x30, 0x40, sshape, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    vs = torch.randint(0x30, 0x40, sshape, dtype=torch.uint8, device=dev).view(torch.float8_e4m3fn)
    return LayerKV("nvfp4", PAGE, HK, D, k, v, ks, vs, K_G, V_G)


def _page_tables(dev, batch, seq_len, rot):
    pages = batch * seq_len // PAGE
    perm = torch.randperm(pages * rot, device=dev).to(torch.int32)
    return [perm[r * pages:(r + 1) * pages].reshape(batch, seq_len // PAGE).contiguous() for r in range(rot)]


def _rotating(fns: list) -> object:
    """A callable that runs fns[0], fns[1], ... in turn (each call reads another copy of the pages)."""
    state = {"i": 0}

    def step():
        state["i"] = (state["i"] + 1) % len(fns)
        return fns[state["i"]]()

    return step


def time_ours(dev, batch, seq_len, configs) -> dict:
    from nvfp4_kernels.backends.triton_backend import TritonBackend

    rot = _rotations(nvfp4_bytes(batch, seq_len))
    layer = _nvfp4_pool(dev, batch, seq_len, rot)
    pts = _page_tables(dev, batch, seq_len, rot)
    seq = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
    q = torch.randn(batch, HQ, D, device=dev).to(torch.bfloat16)
    res = {}
    for cfg in configs:
        tb = TritonBackend(cfg)
        plans = [tb.plan_decode(pt, seq, HQ, HK, D, PAGE) for pt in pts]
        fns = [functools.partial(tb.decode, pl, q, layer, SM_SCALE) for pl in plans]
        us = _bench(_rotating(fns))
        st = plans[0].backend_state
        res[cfg.label] = {"us": us, "graph_us": _bench_graph(fns, us), "splits": st.num_splits,
                          "chunk_tokens": st.chunk_tokens,
                          "kernel": cfg.kernel.value, "config": {**asdict(cfg), "kernel": cfg.kernel.value}}
    return res


def time_flashinfer(dev, batch, seq_len, kv_dtype, cuda_cores: bool) -> dict:
    from nvfp4_kernels.backends.flashinfer_backend import FlashInferDecode
    from nvfp4_kernels.kv_layout import LayerKV

    best = {}
    variants = [(True, "NHD")] + ([(True, "HND")] if kv_dtype == "nvfp4" else [])
    if cuda_cores and kv_dtype != "nvfp4":  # FlashInfer's CUDA-core decode rejects packed NVFP4 (head dims differ)
        variants.append((False, "NHD"))
    for tc, lay in variants:
        try:
            if kv_dtype == "nvfp4":
                nbytes = nvfp4_bytes(batch, seq_len)
                rot = _rotations(nbytes)
                layer = _nvfp4_pool(dev, batch, seq_len, rot, lay)
            else:
                dt = torch.bfloat16 if kv_dtype == "bf16" else torch.float8_e4m3fn
                nbytes = batch * seq_len * HK * D * 2 * dt.itemsize
                rot = _rotations(nbytes)
                pages = batch * seq_len // PAGE * rot
                k = torch.randn(pages, PAGE, HK, D, device=dev).to(dt)
                v = torch.randn(pages, PAGE, HK, D, device=dev).to(dt)
                layer = LayerKV(kv_dtype, PAGE, HK, D, k, v, None, None, 1.0, 1.0)
            pts = _page_tables(dev, batch, seq_len, rot)
            seq = torch.full((batch,), seq_len, dtype=torch.int32, device=dev)
            q = torch.randn(batch, HQ, D, device=dev).to(torch.bfloat16)
            wrappers, graphed = [], []
            for pt in pts:
                fi = FlashInferDecode(dev, use_tensor_cores=tc, kv_layout=lay)
                fi.plan(pt, seq, HQ, HK, D, PAGE, kv_dtype, torch.bfloat16, SM_SCALE)
                wrappers.append(fi)
                gfi = FlashInferDecode(dev, use_tensor_cores=tc, kv_layout=lay, graph_batch=batch, max_pages=pt.numel())
                gfi.plan(pt, seq, HQ, HK, D, PAGE, kv_dtype, torch.bfloat16, SM_SCALE)
                graphed.append(gfi)
            us = _bench(_rotating([functools.partial(w.run, q, layer) for w in wrappers]))
            name = f"{'tc' if tc else 'cuda_cores'}_{lay}"
            best[name] = {"us": us, "bytes": nbytes}
            best[name]["graph_us"] = _bench_graph([functools.partial(w.run, q, layer) for w in graphed], us)
        except Exception:  # noqa: BLE001 - one unsupported FlashInfer path must not stop the benchmark
            best[f"{'tc' if tc else 'cuda_cores'}_{lay}"] = {"error": traceback.format_exc()[-300:]}
        torch.cuda.empty_cache()
    return best


def time_quantize(dev) -> dict:
    from nvfp4_kernels.backends.triton_backend import quantize_rows

    t = 128 * 1024  # tokens of one layer written at once (a 128K-token prefill chunk)
    x = torch.randn(t, HK, D, device=dev).to(torch.bfloat16)
    slots = torch.randperm(t, device=dev)
    data = torch.empty(t, HK, D // 2, dtype=torch.uint8, device=dev)
    sf = torch.empty(t, HK, D // 16, dtype=torch.uint8, device=dev)
    us = _bench(lambda: quantize_rows(x, slots, data, sf, K_G))
    nbytes = x.numel() * 2 + data.numel() + sf.numel() + slots.numel() * 8
    return {"tokens": t, "us": us, "bytes": nbytes, "tb_per_s": nbytes / us / 1e6}


def _prewarm_flashinfer(cuda_cores: bool) -> object:
    """JIT-compile FlashInfer's kernels in a child process while our checks run (each takes ~25 s)."""
    import subprocess

    code = ("import torch, math\nfrom nvfp4_kernels.backends.flashinfer_backend import *\n"
            "from benchmarks.kernels.bench_decode import time_flashinfer\n"
            "dev = torch.device('cuda')\n"
            "for kvd in ('bf16', 'fp8_e4m3', 'nvfp4'):\n"
            f"    time_flashinfer(dev, 2, 256, kvd, {bool(cuda_cores)})\n"
            "x = torch.zeros(16, 64, dtype=torch.uint8, device=dev)\n"
            "nvfp4_dequantize_rows(x, torch.zeros(16, 8, dtype=torch.uint8, device=dev), 1.0)\n")
    return subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def main(argv: list[str] | None = None) -> int:
    from nvfp4_kernels.backends.decode_choice import prefers_lean_step
    from nvfp4_kernels.backends.flashinfer_backend import flashinfer_available
    from nvfp4_kernels.backends.triton_backend import DecodeConfig, DecodeKernel, default_decode_config

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="docs/benchmarks/kernels.json")
    ap.add_argument("--sweep", action="store_true", help="also time other decode tilings")
    ap.add_argument("--cuda-cores", action="store_true", help="also time FlashInfer's CUDA-core decode")
    ap.add_argument("--quick", action="store_true", help="first two shapes only")
    ap.add_argument("--md", default=None, metavar="MD",
                    help="write the default kernel's table into this markdown file, between its markers")
    ap.add_argument("--flashinfer-from", default=None, metavar="JSON",
                    help="reuse the FlashInfer timings of an earlier run's JSON instead of timing them again")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks.kernels.bench_decode needs a CUDA GPU", file=sys.stderr)
        return 2
    dev = torch.device("cuda")
    reused = _load_flashinfer_rows(args.flashinfer_from) if args.flashinfer_from else None
    have_fi = flashinfer_available() and reused is None
    warm = _prewarm_flashinfer(args.cuda_cores) if have_fi else None
    t0 = time.time()
    report: dict = {"device": torch.cuda.get_device_name(dev), "torch": torch.__version__,
                        "geometry": {"num_qo_heads": HQ, "num_kv_heads": HK, "head_dim": D, "page_size": PAGE}}
    import triton

    report["triton"] = triton.__version__
    report["copy_tb_per_s"] = copy_bandwidth(dev)
    _log(f"copy bandwidth {report['copy_tb_per_s']:.2f} TB/s (read + write)")
    report["checks"] = run_checks(dev)
    report["quantize"] = time_quantize(dev)
    _log(f"quantize kernel: {report['quantize']['tokens']} tokens in {report['quantize']['us']:.0f} us = "
         f"{report['quantize']['tb_per_s']:.2f} TB/s")
    triton_cfg = DecodeConfig(4, 16 if D > 128 else 32, 2, 8)  # the Triton kernel's measured best tiling
    gluon, tma = DecodeKernel.GLUON, DecodeKernel.GLUON_TMA
    default = default_decode_config(D, torch.cuda.get_device_capability(dev), HQ // HK, num_kv_heads=HK,
                                    page_size=PAGE, lean_step=prefers_lean_step(torch.cuda.get_device_name(dev)))
    report["default_config"] = default.label  # what the engine runs on this GPU (auto)
    # the TMA kernel with each step (kept and lean: the default picks by GPU), its grid in waves of whole rounds of
    # the programs that fit on an SM (kept: one and two rounds of 12; lean: two and three of 16); the cp.async
    # kernel's in two rounds of its 12
    configs = list(dict.fromkeys([default, triton_cfg, DecodeConfig(1, 32, 2, 24, gluon), DecodeConfig(1, 32, 2, 24, tma),
                                  DecodeConfig(1, 32, 2, 12, tma), DecodeConfig(1, 32, 2, 32, tma, lean=True),
                                  DecodeConfig(1, 32, 2, 48, tma, lean=True)]))
    if args.sweep:
        configs += [DecodeConfig(1, 32, 3, 24, tma), DecodeConfig(1, 16, 3, 24, tma)]
        configs += [DecodeConfig(4, 32, 2, 16), DecodeConfig(1, 32, 2, 32), DecodeConfig(1, 32, 4, 24, gluon),
                    DecodeConfig(1, 16, 4, 32, gluon), DecodeConfig(1, 32, 2, 32, gluon), DecodeConfig(1, 64, 2, 12, gluon),
                    DecodeConfig(1, 16, 3, 48, gluon), DecodeConfig(1, 32, 2, 24, gluon, 104),
                    DecodeConfig(1, 32, 2, 32, gluon, 104), DecodeConfig(1, 32, 3, 32, gluon, 112),
                    DecodeConfig(1, 32, 2, 24, gluon, 128), DecodeConfig(1, 16, 3, 48, gluon, 112)]
    if warm is not None:
        warm.wait()
    rows = []
    for batch, seq_len in SHAPES[:2] if args.quick else SHAPES:
        entry: dict = {"batch": batch, "seq_len": seq_len, "nvfp4_bytes": nvfp4_bytes(batch, seq_len)}
        entry["ours"] = time_ours(dev, batch, seq_len, configs)
        if have_fi:
            for kvd in ("bf16", "fp8_e4m3", "nvfp4"):
                entry[f"flashinfer_{kvd}"] = time_flashinfer(dev, batch, seq_len, kvd, args.cuda_cores)
        elif reused is not None and (batch, seq_len) in reused:
            entry.update(reused[(batch, seq_len)])
            entry["flashinfer_source"] = f"reused from {args.flashinfer_from} ({reused['device']})"
        rows.append(entry)
        report["decode"] = rows
        _write(report, args.out)  # after every shape, so a cut-short run still leaves its numbers
        _log(f"timed {batch}x{seq_len} ({time.time() - t0:.0f}s)")
    _print_table(report)
    _write(report, args.out)
    _log(f"wrote {args.out}")
    if args.md:
        write_markdown_table(report, args.md, " ".join(["python -m benchmarks.kernels.bench_decode", *(argv or sys.argv[1:])]))
        _log(f"wrote the table of {args.md}")
    return 0


def _load_flashinfer_rows(path: str) -> dict:
    with open(path) as f:
        old = json.load(f)
    rows = {(e["batch"], e["seq_len"]): {k: v for k, v in e.items() if k.startswith("flashinfer_")}
            for e in old.get("decode", [])}
    rows["device"] = old.get("device", "?")
    return rows


def _write(report: dict, path: str) -> None:
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)


def _best(d: dict, key: str = "us") -> tuple[str, float, int | None]:
    ok = {k: v for k, v in d.items() if key in v}
    if not ok:
        return "-", float("nan"), None
    k = min(ok, key=lambda n: ok[n][key])
    return k, ok[k][key], ok[k].get("bytes")


def _print_table(report: dict) -> None:
    copy = report["copy_tb_per_s"]
    _log(f"\nNVFP4 decode, GQA {HQ}/{HK}, D={D}, page {PAGE}; copy bandwidth {copy:.2f} TB/s; "
         f"TB/s = each format's own K+V bytes / time")
    hdr = (f"{'shape':>12} | {'triton':>7} {'gluon':>7} {'tma':>7} | {'ours us':>8} {'TB/s':>5} {'%copy':>5} | {'FI bf16':>8} {'FI fp8':>8} {'FI nvfp4':>8} |"
           f" {'x bf16':>6} {'x fp8':>6} {'x nvfp4':>7} | {'85% goal us':>10}")
    _log(hdr)
    _log("-" * len(hdr))
    for e in report["decode"]:
        name, ours, _ = _best(e["ours"])
        per = {kn: _best({k: v for k, v in e["ours"].items() if v.get("kernel") == kn})[1]
               for kn in ("triton", "gluon", "gluon-tma")}
        tbs = e["nvfp4_bytes"] / ours / 1e6
        fi = {k: _best(e.get(f"flashinfer_{k}", {}))[1] for k in ("bf16", "fp8_e4m3", "nvfp4")}
        goal = e["nvfp4_bytes"] / (0.85 * copy * 1e6)
        gname, gours, _ = _best(e["ours"], "graph_us")
        gfi = {k: _best(e.get(f"flashinfer_{k}", {}), "graph_us")[1] for k in ("bf16", "fp8_e4m3", "nvfp4")}
        e["summary"] = {"best_config": name, "ours_us": ours, "best_us_per_kernel": per, "ours_tb_per_s": tbs, "pct_of_copy": 100 * tbs / copy,
                            "flashinfer_us": fi, "speedup": {k: fi[k] / ours for k in fi}, "goal_85pct_us": goal,
                            "graph": {"best_config": gname, "ours_us": gours, "ours_tb_per_s": e["nvfp4_bytes"] / gours / 1e6,
                                      "pct_of_copy": 100 * e["nvfp4_bytes"] / gours / 1e6 / copy, "flashinfer_us": gfi,
                                      "speedup": {k: gfi[k] / gours for k in gfi}}}
        _log(f"{e['batch']:>4}x{e['seq_len']:<7} | {per['triton']:7.0f} {per['gluon']:7.0f} {per['gluon-tma']:7.0f} | {ours:8.0f} {tbs:5.2f} {100 * tbs / copy:5.0f} | {fi['bf16']:8.0f} "
             f"{fi['fp8_e4m3']:8.0f} {fi['nvfp4']:8.0f} | {fi['bf16'] / ours:6.2f} {fi['fp8_e4m3'] / ours:6.2f} "
             f"{fi['nvfp4'] / ours:7.2f} | {goal:10.0f}")
    _log("\nthe same, each call replayed from a CUDA graph (as the engine's decode step runs it)")
    _log(hdr.replace("triton", "      ").replace("  gluon", "       ").replace("    tma", "       "))
    for e in report["decode"]:
        g = e["summary"]["graph"]
        ours, fi = g["ours_us"], g["flashinfer_us"]
        _log(f"{e['batch']:>4}x{e['seq_len']:<7} | {'':7} {'':7} {'':7} | {ours:8.1f} {g['ours_tb_per_s']:5.2f} {g['pct_of_copy']:5.0f} | "
             f"{fi['bf16']:8.1f} {fi['fp8_e4m3']:8.1f} {fi['nvfp4']:8.1f} | {fi['bf16'] / ours:6.2f} {fi['fp8_e4m3'] / ours:6.2f} "
             f"{fi['nvfp4'] / ours:7.2f} | {e['summary']['goal_85pct_us']:10.0f}")
    q = report["quantize"]
    _log(f"quantize-on-write: {q['tokens']} tokens x {HK} heads x {D}: {q['us']:.0f} us, {q['tb_per_s']:.2f} TB/s")



_MD_BEGIN, _MD_END = "<!-- bench_decode: generated, begin -->", "<!-- bench_decode: generated, end -->"


def markdown_table(report: dict, command: str) -> str:
    """The default kernel (``report["default_config"]``, what the engine runs) against the other kernels and
    FlashInfer, every shape: eager and graph microseconds, TB/s of its own bytes against the copy bandwidth."""
    copy, default = report["copy_tb_per_s"], report.get("default_config")
    lines = [(f"Produced by `{command}` on {report['device']} (copy bandwidth {copy:.2f} TB/s, read + write; "
              f"triton {report.get('triton', '?')}). Default kernel on this GPU: `{default}`."), "",
             ("| batch x context | default (eager) | default (graph) | TB/s (% of copy), graph | Gluon cp.async | "
              "Triton | FlashInfer BF16 | FlashInfer FP8 | FlashInfer NVFP4 | vs BF16 | vs FP8 | vs NVFP4 | "
              "80% of copy |"),
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def fi(e: dict, kvd: str) -> tuple[float, float]:
        return _best(e.get(f"flashinfer_{kvd}", {}))[1], _best(e.get(f"flashinfer_{kvd}", {}), "graph_us")[1]

    for e in report["decode"]:
        ours = e["ours"].get(default, {})
        us, gus = ours.get("us", float("nan")), ours.get("graph_us", float("nan"))
        tbs = e["nvfp4_bytes"] / gus / 1e6
        other = {kn: _best({k: v for k, v in e["ours"].items() if v.get("kernel") == kn and k != default})[1]
                 for kn in ("gluon", "triton")}
        f = {k: fi(e, k) for k in ("bf16", "fp8_e4m3", "nvfp4")}
        goal = e["nvfp4_bytes"] / (0.8 * copy * 1e6)
        shape = f"{e['batch']} x {e['seq_len'] // 1024}K" if e["seq_len"] < 1 << 20 else f"{e['batch']} x 1M"
        lines.append(f"| {shape} | {us:.1f} us | {gus:.1f} us | {tbs:.2f} ({100 * tbs / copy:.0f}%) | "
                     f"{other['gluon']:.1f} us | {other['triton']:.1f} us | "
                     + " | ".join(f"{a:.1f} / {b:.1f} us" for a, b in f.values())
                     + " | " + " | ".join(f"{b / gus:.2f}x" for _, b in f.values()) + f" | {goal:.0f} us |")
    lines += ["", ("FlashInfer columns: eager / graph; speedups are graph against graph. Gluon cp.async and Triton: "
                   "the best of their tilings timed, eager.")]
    return "\n".join(lines)


def write_markdown_table(report: dict, path: str, command: str) -> None:
    """Replace the generated part of ``path`` (between its markers; appended with them where absent)."""
    text = ""
    if os.path.exists(path):
        with open(path) as f:
            text = f.read()
    block = f"{_MD_BEGIN}\n{markdown_table(report, command)}\n{_MD_END}"
    if _MD_BEGIN in text and _MD_END in text:
        head, rest = text.split(_MD_BEGIN, 1)
        text = head + block + rest.split(_MD_END, 1)[1]
    else:
        text = text.rstrip("\n") + ("\n\n" if text else "") + block + "\n"
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
