"""Engine decode-step benchmark: one whole model step (all layers, sampling input) per KV dtype, on GPU.

    python -m benchmarks.engine.bench_decode_step [--layers 36] [--shapes 44x32768 ...] [--no-fused] [--out JSON]

What it measures: ``ModelRunner.decode_logits`` of a Qwen3-8B-shaped model (hidden 4096, 32/8 heads,
head_dim 128, intermediate 12288, vocab 151936; random bf16 weights built in memory) over B sequences of
L cached tokens, with the pool filled with random valid K/V bytes instead of a prefill (which would cost
minutes per shape). Per dtype (bf16, fp8_e4m3 via FlashInfer, nvfp4 via our Triton kernel) and shape:
the step under CUDA graphs and eagerly, the attention share (the decode kernels alone over all layers, their
loop captured as one CUDA graph as the step's is; also that loop launched eagerly from Python, which at small
batches times the host) and the decode throughput B / step. "does not fit" when the weights + pool exceed the
GPU. The rest of the step (graph step - graph attention: matmuls, norms, activations, RoPE, K/V write, logits)
is shown beside its floor, the weight bytes one step reads (every parameter once, B rows of the embedding) at
the measured copy bandwidth; the same step queued back to back (each staged while the last one runs, as overlap
scheduling serves them) shows what the host's staging still costs. ``--profile`` adds the kernels of one graph replay (torch profiler): the top ones,
their sum per category (GEMM, attention incl. merge, K/V write, norms + RoPE + activation, other) and the
launch gaps, graph step - kernel sum. ``--no-fused`` runs the model's PyTorch norm/activation/RoPE ops instead
of the fused Triton kernels (nvfp4_kernels/model_ops.py), for the before/after of the same shapes; ``--pdl-modes on
off`` runs each shape with and without programmatic dependent launch of the step's small kernels, and
``--linear-modes skinny cublas`` with the decode projections through the skinny linear where it applies (as the
engine runs them) and all through cuBLAS. ``--only-without-attention`` times only the step with each layer's
attention replaced by one small kernel, over a pool of just the pages the step writes.

The ratio nvfp4 / fp8 of tokens/s at the same shape is the engine-level iso-concurrency figure; the
end-to-end figures (router, gRPC, streaming) come from ``nvfp4-serve bench experiments``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
import time
import traceback

import numpy as np
import torch

from benchmarks.engine.decode_step_report import CATEGORY_NAMES, print_table, write_md
from benchmarks.kernels.bench_decode import copy_bandwidth
from nvfp4_kernels import programmatic_launch
from nvfp4_kernels.backends.decode_kernels import NVFP4_DECODE_KERNELS

QWEN3_8B = {"architecture": "Qwen3ForCausalLM", "vocab_size": 151936, "hidden_size": 4096,
            "intermediate_size": 12288, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "rope_theta": 1e6, "qk_norm": True, "rms_norm_eps": 1e-6}
PAGE = 16


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def build_model(layers: int, max_positions: int, device: torch.device, fused_ops: bool = True):
    from engine.model import CausalLM
    from engine.model_config import ModelConfig

    cfg = ModelConfig(num_hidden_layers=layers, max_position_embeddings=max_positions, **QWEN3_8B)
    model = CausalLM(cfg, torch.bfloat16, device, fused_ops=fused_ops)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    return model, cfg


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of weights one decode step reads: every parameter once, but only ``batch`` rows of the embedding
    (with tied embeddings the logits read the whole matrix, so it counts once in full)."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if model.lm_head is not None:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size() - batch * emb.shape[1] * emb.element_size()
    return total


def fill_pool_random(pool) -> None:
    """Random but valid bytes everywhere: E2M1 codes are any nibble; E4M3 bytes avoid NaN (0x7F/0xFF)."""
    for layer in pool.layers:
        for t in (layer.k, layer.v):
            if t.dtype == torch.bfloat16:
                t.normal_(0.0, 0.5)
            elif layer.kv_dtype == "nvfp4":
                t.view(torch.uint8).random_(0, 256)
            else:
                b = t.view(torch.uint8)
                b.random_(0, 0x70)
                b.bitwise_or_(torch.randint_like(b, 0, 2) << 7)
        for sf in (layer.k_sf, layer.v_sf):
            if sf is not None:
                sf.view(torch.uint8).random_(0x28, 0x38)  # 2^-6 .. 2^-4: moderate block scales


def _time_ms(fn, samples: int, calls: int = 1) -> float:
    """Median over ``samples`` of the mean ms per call of ``calls`` calls queued back to back. With several calls
    each one stages its inputs on the host while the last one still runs on the GPU, as decode steps run under
    overlap scheduling (the engine's default): the host's staging then costs nothing while it stays below the
    GPU's time. One call per sample times a step alone, its staging included."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(samples):
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    times.sort()
    return times[len(times) // 2]


# Kernel categories of the profile, by name (lowercased), first match wins. Attention comes before the norms
# (FlashInfer's attention kernel names carry template arguments such as its RoPE mode); K/V write first.
KERNEL_CATEGORIES = (
    ("kv_write", ("kv_write", "nvfp4_quantize")),
    ("attention", ("decode", "merge", "batchprefill", "attention")),
    ("gemm", ("nvjet", "gemm", "splitkreduce", "cublas", "cutlass", "xmma", "skinny_linear")),
    ("norm_rope_act", ("rmsnorm", "norm", "rope", "rotary", "silu", "gelu")),
)


def kernel_category(name: str) -> str:
    """The category of a profiled kernel (or copy) name: one of ``CATEGORY_NAMES``."""
    low = name.lower()
    return next((cat for cat, keys in KERNEL_CATEGORIES if any(k in low for k in keys)), "other")


def profile_kernels(step, steps: int = 3) -> list[dict]:
    """Every GPU activity (kernels, copies) of ``step`` under the torch profiler, ``steps`` steps averaged: name,
    microseconds and launches per step, by device time descending."""
    from torch.profiler import ProfilerActivity, profile

    step()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    per_kernel: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            acc = per_kernel.setdefault(ev.name, [0.0, 0])
            acc[0] += ev.device_time_total
            acc[1] += 1
    return sorted(({"kernel": k, "us": v[0] / steps, "launches": v[1] / steps} for k, v in per_kernel.items()),
                  key=lambda r: -r["us"])


def top_kernels(rows: list[dict], top: int = 12) -> list[dict]:
    """The ``top`` rows (names cut to 120 characters) and the rest summed as one row."""
    out = [dict(r, kernel=r["kernel"][:120]) for r in rows[:top]]
    rest = rows[top:]
    if rest:
        out.append({"kernel": f"{len(rest)} other kernels", "us": sum(r["us"] for r in rest),
                    "launches": sum(r["launches"] for r in rest)})
    return out


def category_ms(rows: list[dict]) -> dict[str, float]:
    """Milliseconds per step of each category (every one of ``CATEGORY_NAMES``) and their ``total``."""
    out = dict.fromkeys(CATEGORY_NAMES, 0.0)
    for r in rows:
        out[kernel_category(r["kernel"])] += r["us"] / 1e3
    out["total"] = sum(out.values())
    return out


def step_profile(graph_step, eager_step, graph_ms: float, eager_ms: float) -> dict:
    """Where one step's GPU time goes: the kernels of a CUDA graph replay (the step ``graph_ms`` measures) by
    category, and ``launch_gaps_ms`` = graph_ms - their sum (the time the GPU runs none of the step's kernels:
    the host's staging before the replay and the gaps between kernels; negative where kernels overlapped).
    Where the profiler sees no kernel inside the replay, the eager step's kernels are used and the gaps are
    eager_ms - sum (``kernels_from`` says which)."""
    rows, source, step_ms = profile_kernels(graph_step), "graph", graph_ms
    if not any(kernel_category(r["kernel"]) != "other" for r in rows):
        rows, source, step_ms = profile_kernels(eager_step), "eager", eager_ms
    cats = category_ms(rows)
    return {"kernels": top_kernels(rows), "kernels_from": source, "kernel_ms": cats,
            "launch_gaps_ms": step_ms - cats["total"]}


def _decode_table(batch: int, seq_len: int, pages_per_seq: int, width: int,
                  fill_page: int) -> tuple[np.ndarray, np.ndarray]:
    """The benchmark's page table [batch, width] int32 (row i: pages i * pages_per_seq ..., then ``fill_page``,
    which no kernel reads) and lengths [batch] int32, ``seq_len`` each."""
    table = np.full((batch, width), fill_page, dtype=np.int32)
    for i in range(batch):
        table[i, :pages_per_seq] = np.arange(i * pages_per_seq, (i + 1) * pages_per_seq, dtype=np.int32)
    return table, np.full(batch, seq_len, dtype=np.int32)


def attention_times(paths, batch: int, seq_len: int, pages_per_seq: int, width: int, iters: int,
                    device: torch.device) -> dict:
    """The decode of every layer alone (no model, no K/V write) over the step's pages, B rows of ``seq_len``
    tokens: ``attention_graph_ms``, the loop over layers captured as a CUDA graph on a static plan of the step's
    table width (as ``DecodeGraphRunner`` captures the whole step), and ``attention_eager_ms``, the same loop
    run from Python on a plan of the exact width (host-bound at small batches)."""
    from engine.decode_graphs import capture_graph

    pool, backend = paths.pool, paths.backend
    q = torch.randn(batch, paths.num_qo_heads, pool.layers[0].head_dim, dtype=torch.bfloat16, device=device)

    def loop(plan):
        def run() -> torch.Tensor:
            return [backend.decode(plan, q, layer, paths.sm_scale) for layer in pool.layers][-1]
        return run

    table, lens = _decode_table(batch, seq_len, pages_per_seq, width, pool.scratch_page)
    static = paths.plan_decode(torch.from_numpy(table).to(device), torch.from_numpy(lens).to(device),
                               torch.bfloat16, static=True)
    backend.refresh_decode_plan(static, table, lens)
    replay = capture_graph(loop(static), device)
    exact = paths.plan_decode(torch.from_numpy(np.ascontiguousarray(table[:, :pages_per_seq])).to(device),
                              torch.from_numpy(lens).to(device), torch.bfloat16)
    n = max(3, iters // 2)
    return {"attention_graph_ms": _time_ms(replay, n), "attention_eager_ms": _time_ms(loop(exact), n)}


def row_pages(seq_len: int, page: int, compact: bool) -> tuple[int, int]:
    """(first owned table entry, owned pages) of a row whose step writes token ``seq_len - 1`` (the table holds
    ``seq_len + 1`` tokens). Compact (the step without attention, where nothing reads the pool): a row owns only
    the pages from the one its token is written to, its earlier entries name the scratch page, so every shape
    fits wherever the weights do; otherwise every page."""
    pages = math.ceil((seq_len + 1) / page)
    first = (seq_len - 1) // page if compact else 0
    return first, pages - first


def no_attention_times(model, paths, device: torch.device, reqs: list, max_width: int, iters: int,
                       profile: bool = False) -> dict:
    """The same step with its decode attention replaced by one small kernel (``AttentionStandIn``), under CUDA
    graphs as the step runs: ``no_attention_ms`` alone and ``no_attention_back_to_back_ms`` queued back to back.
    The rest of the step measured directly, not as the difference of two large figures. With ``profile`` (only
    asked where the whole step is not run) this step's kernels, as ``step_profile`` gives them, and its eager
    time ``no_attention_eager_ms``."""
    from benchmarks.engine.attention_stand_in import AttentionStandIn
    from engine.attention_paths import AttentionPaths
    from engine.decode_graphs import DecodeGraphRunner
    from engine.model_runner import ModelRunner

    stand_in = AttentionPaths(paths.pool, AttentionStandIn(paths.backend), paths.workspace_tokens,
                              paths.num_qo_heads, paths.sm_scale, device)
    runner = ModelRunner(model, stand_in, device, DecodeGraphRunner(model, stand_in, device, max(len(reqs), 1),
                                                                    max_width, True))
    runner.decode_logits(reqs)  # captures
    out = {"no_attention_ms": _time_ms(lambda: runner.decode_logits(reqs), iters),
           "no_attention_back_to_back_ms": _time_ms(lambda: runner.decode_logits(reqs), 3, calls=iters)}
    if profile:
        out["no_attention_eager_ms"] = _time_ms(lambda: runner.decode_logits(reqs, use_graphs=False), 3)
        out.update(step_profile(lambda: runner.decode_logits(reqs),
                                lambda: runner.decode_logits(reqs, use_graphs=False), out["no_attention_ms"],
                                out["no_attention_eager_ms"]))
        out["profiled"] = "step without attention"
    return out


def run_shape(model, cfg, kv_dtype: str, batch: int, seq_len: int, iters: int, device: torch.device,
              profile: bool = False, block_select: bool = False, only_without_attention: bool = False,
              nvfp4_decode_kernel: str = "auto") -> dict:
    """One row: the step (graph, back to back, eager), its attention alone and the step without attention; with
    ``only_without_attention`` the last alone (no attention kernel is planned or compiled: FlashInfer stays
    unloaded for bf16/fp8)."""
    from engine.attention_paths import AttentionPaths
    from engine.decode_graphs import DecodeGraphRunner, max_width_pages, width_bucket
    from engine.kv_pool import KVPool
    from engine.model_runner import ModelRunner
    from engine.request import Request
    from engine.sampling import SamplingParams
    from nvfp4_kernels.backends.triton_backend import TritonBackend, TritonBlockSelectBackend
    from nvfp4_kernels.kv_layout import bytes_per_token_per_layer

    pages_per_seq = math.ceil((seq_len + 1) / PAGE)
    first_own, own_pages = row_pages(seq_len, PAGE, compact=only_without_attention)
    num_pages = batch * own_pages
    per_token = cfg.num_hidden_layers * bytes_per_token_per_layer(kv_dtype, cfg.num_key_value_heads, cfg.head_dim)
    pool_bytes = num_pages * PAGE * per_token
    free, _ = torch.cuda.mem_get_info(device)
    if pool_bytes > free - 6 * 2**30:
        return {"kv_dtype": kv_dtype, "batch": batch, "seq_len": seq_len, "error": "does not fit",
                "pool_gib": pool_bytes / 2**30}
    scales = [0.05] * cfg.num_hidden_layers
    pool = KVPool(kv_dtype, cfg.num_hidden_layers, num_pages, PAGE, cfg.num_key_value_heads, cfg.head_dim,
                  device=device, k_scales=scales, v_scales=scales, scratch_pages=1)
    fill_pool_random(pool)
    from nvfp4_kernels.backends.decode_kernels import DecodeKernel

    kernel = None if nvfp4_decode_kernel == "auto" else DecodeKernel(nvfp4_decode_kernel)
    backend = (TritonBlockSelectBackend if block_select else TritonBackend)(decode_kernel=kernel)
    paths = AttentionPaths(pool, backend, PAGE, cfg.num_attention_heads, cfg.head_dim ** -0.5, device)
    width = max_width_pages(seq_len + 64, PAGE)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    reqs = []
    for i in range(batch):
        own = list(range(i * own_pages, (i + 1) * own_pages))
        page_ids = [pool.scratch_page] * first_own + own if first_own else own
        r = Request(f"r{i}", [1] * seq_len, sp, page_ids=page_ids)
        r.kv_len = seq_len - 1  # the step writes token seq_len-1 and attends over seq_len tokens
        reqs.append(r)
    out = {"kv_dtype": kv_dtype, "batch": batch, "seq_len": seq_len, "pool_gib": pool_bytes / 2**30,
           "weight_gb": weight_bytes_per_step(model, batch) / 1e9}
    if only_without_attention:
        out["pool"] = "compact: the pages the step writes"
        return {**out, **no_attention_times(model, paths, device, reqs, width, iters, profile)}
    graphs = DecodeGraphRunner(model, paths, device, max(batch, 1), width, True)
    runner = ModelRunner(model, paths, device, graphs)
    t0 = time.perf_counter()
    runner.decode_logits(reqs)  # captures the graph of this bucket
    out["capture_s"] = time.perf_counter() - t0
    out["graph_ms"] = _time_ms(lambda: runner.decode_logits(reqs), iters)
    out["back_to_back_ms"] = _time_ms(lambda: runner.decode_logits(reqs), 3, calls=iters)
    out["eager_ms"] = _time_ms(lambda: runner.decode_logits(reqs, use_graphs=False), max(3, iters // 3))
    out.update(attention_times(paths, batch, seq_len, pages_per_seq, width_bucket(pages_per_seq, graphs.max_width),
                               iters, device))
    kv_bytes = batch * seq_len * per_token
    out["kv_read_gb"] = kv_bytes / 1e9
    out["attention_tb_s"] = kv_bytes / (out["attention_graph_ms"] * 1e-3) / 1e12
    out["tok_s"] = batch / (out["graph_ms"] * 1e-3)
    out["non_attention_ms"] = out["graph_ms"] - out["attention_graph_ms"]
    out.update(no_attention_times(model, paths, device, reqs, width, iters))
    if profile:
        out.update(step_profile(lambda: runner.decode_logits(reqs),
                                lambda: runner.decode_logits(reqs, use_graphs=False), out["graph_ms"], out["eager_ms"]))
    return out  # the pool and graphs are freed with this frame; main() empties the cache


def _measure(a: argparse.Namespace, model, cfg, dev: torch.device, bw: float) -> list[dict]:
    """Every (--kv-rotations, shape, dtype, --pdl-modes) row, in that order of loops."""
    rows = []
    for rotation in a.kv_rotations:
        if rotation != "none":
            from engine.kv_rotation import head_rotation

            model.rotate_kv(head_rotation(rotation, cfg.head_dim, dev, model.dtype))
        from nvfp4_kernels import skinny_linear

        for (b, l), dt, pdl, lin, kern in itertools.product(a.shapes, a.kv_dtypes, a.pdl_modes, a.linear_modes,
                                                            a.nvfp4_decode_kernels):
            if dt != "nvfp4" and kern != a.nvfp4_decode_kernels[0]:
                continue  # the kernel choice is the NVFP4 decode's: other dtypes are measured once
            programmatic_launch.set_enabled(pdl == "on")  # the graphs of run_shape are captured under it
            skinny_linear.set_skinny_linear(lin == "skinny")  # and under this
            try:
                row = run_shape(model, cfg, dt, b, l, a.iters, dev, a.profile, a.block_select,
                                a.only_without_attention, kern)
            except Exception as e:  # noqa: BLE001 - recorded, the other shapes go on
                traceback.print_exc()
                row = {"kv_dtype": dt, "batch": b, "seq_len": l, "error": f"{type(e).__name__}: {e}"}
                torch.cuda.empty_cache()
            # pdl: the mode asked for (rows are paired by it); pdl_launched: whether this GPU launched with it
            row.update(kv_rotation=rotation, pdl=pdl == "on", linear=lin, nvfp4_decode_kernel=kern,
                       pdl_launched=programmatic_launch.uses_pdl(torch.empty(0, device=dev)))
            if "weight_gb" in row:
                row["non_attention_floor_ms"] = row["weight_gb"] / bw
            rows.append(row)
            torch.cuda.empty_cache()
            _log(json.dumps(row))
    return rows


def _shape(s: str) -> tuple[int, int]:
    b, _, l = s.lower().partition("x")
    return int(b), int(l)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=36)
    p.add_argument("--kv-dtypes", nargs="+", default=["bf16", "fp8_e4m3", "nvfp4"])
    p.add_argument("--shapes", nargs="+", type=_shape,
                   default=[(1, 32768), (16, 32768), (44, 32768), (80, 32768), (10, 163840), (1, 1048576)])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--no-fused", action="store_true",
                   help="the model's PyTorch norm/activation/RoPE ops instead of the fused Triton kernels")
    p.add_argument("--block-select", action="store_true",
                   help="nvfp4 pool writes with the per-block scale search (--attention-backend triton-block-select)")
    p.add_argument("--kv-rotations", nargs="+", default=["none"], choices=["none", "hadamard"],
                   help="run every shape and dtype under each --kv-rotation, in this order (none first: the model "
                        "is rotated in place once), so the rotation's cost per step is measured in the same run")
    p.add_argument("--pdl-modes", nargs="+", default=["on"], choices=["on", "off"],
                   help="run every shape and dtype with the step's small kernels launched with programmatic dependent "
                        "launch (on) and/or without (off), in this order, for the before/after of the same run")
    p.add_argument("--linear-modes", nargs="+", default=["skinny"], choices=["skinny", "cublas"],
                   help="run every shape and dtype with the decode projections through the skinny linear where it "
                        "applies (skinny, as the engine runs them) and/or all through cuBLAS, in this order, for the "
                        "before/after of the same run")
    p.add_argument("--nvfp4-decode-kernels", nargs="+", default=["auto"], choices=NVFP4_DECODE_KERNELS,
                   help="nvfp4 rows with each of these decode kernels (--nvfp4-decode-kernel), the first the baseline "
                        "of the same-run comparison")
    p.add_argument("--profile", action="store_true",
                   help="also profile each shape's graph replay (torch profiler): top kernels, kernel time per "
                        "category and the launch gaps (graph step - kernel sum); with --only-without-attention, "
                        "of the step without attention")
    p.add_argument("--only-without-attention", action="store_true",
                   help="time only the step with its decode attention replaced by one small kernel (the rest of the "
                        "step, directly): no attention kernel is compiled, a quick check of the non-attention work")
    p.add_argument("--out", default="docs/benchmarks/engine_decode.json")
    p.add_argument("--md", default=None, help="also write the table as markdown here")
    p.add_argument("--render", default=None, metavar="JSON", help="only render --md from an earlier JSON")
    a = p.parse_args(argv)
    if a.block_select and set(a.kv_dtypes) != {"nvfp4"}:
        p.error("--block-select changes only nvfp4 pool writes: give --kv-dtypes nvfp4")
    if len(set(a.kv_rotations)) != len(a.kv_rotations) or a.kv_rotations[1:].count("none"):
        p.error("--kv-rotations: each once, none (if given) first")
    if len(set(a.pdl_modes)) != len(a.pdl_modes):
        p.error("--pdl-modes: each once")
    if len(set(a.linear_modes)) != len(a.linear_modes):
        p.error("--linear-modes: each once")
    if len(set(a.nvfp4_decode_kernels)) != len(a.nvfp4_decode_kernels):
        p.error("--nvfp4-decode-kernels: each once")
    if a.no_fused and a.linear_modes != ["cublas"]:
        p.error("--no-fused runs every projection through cuBLAS: give --linear-modes cublas")
    if a.render:
        with open(a.render) as f:
            doc = json.load(f)
        write_md(doc, a.md or a.render.removesuffix(".json") + ".md")
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_step needs a CUDA GPU")
    dev = torch.device("cuda")
    max_len = max(l for _, l in a.shapes) + 128
    model, cfg = build_model(a.layers, max_len, dev, fused_ops=not a.no_fused)
    bw = copy_bandwidth(dev)
    pdl_before = programmatic_launch.enabled()
    try:
        rows = _measure(a, model, cfg, dev, bw)
    finally:
        from nvfp4_kernels import skinny_linear

        programmatic_launch.set_enabled(pdl_before)
        skinny_linear.set_skinny_linear(True)
    print_table(rows, a.layers)
    doc = {"gpu": torch.cuda.get_device_name(dev), "copy_tb_s": bw, "layers": a.layers, "fused_ops": not a.no_fused,
           "block_select": a.block_select, "kv_rotations": a.kv_rotations,
           "pdl_modes": a.pdl_modes, "linear_modes": a.linear_modes, "only_without_attention": a.only_without_attention,
           "model": "Qwen3-8B-shaped, random bf16 weights", "command": " ".join(["python -m benchmarks.engine.bench_decode_step", *sys.argv[1:]]), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.out}")
    if a.md:
        write_md(doc, a.md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
