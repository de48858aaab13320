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
the measured copy bandwidth. ``--profile`` adds the kernels of one graph replay (torch profiler): the top ones,
their sum per category (GEMM, attention incl. merge, K/V write, norms + RoPE + activation, other) and the
launch gaps, graph step - kernel sum. ``--no-fused`` runs the model's PyTorch norm/activation/RoPE ops instead
of the fused Triton kernels (kernels/model_ops.py), for the before/after of the same shapes.

The ratio nvfp4 / fp8 of tokens/s at the same shape is the engine-level iso-concurrency figure; the
end-to-end figures (router, gRPC, streaming) come from ``nvfp4-serve bench experiments``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
import traceback

import numpy as np
import torch

from benchmarks.kernels.bench_decode import copy_bandwidth

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


def _time_ms(fn, iters: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


# Kernel categories of the profile, by name (lowercased), first match wins. Attention comes before the norms
# (FlashInfer's attention kernel names carry template arguments such as its RoPE mode); K/V write first.
KERNEL_CATEGORIES = (
    ("kv_write", ("kv_write", "nvfp4_quantize")),
    ("attention", ("decode", "merge", "batchprefill", "attention")),
    ("gemm", ("nvjet", "gemm", "splitkreduce", "cublas", "cutlass", "xmma")),
    ("norm_rope_act", ("rmsnorm", "norm", "rope", "rotary", "silu", "gelu")),
)
CATEGORY_NAMES = {"gemm": "GEMM", "attention": "attention incl. merge", "kv_write": "K/V write",
                  "norm_rope_act": "norms + rope + activation", "other": "other"}


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


def run_shape(model, cfg, kv_dtype: str, batch: int, seq_len: int, iters: int, device: torch.device,
              profile: bool = False, block_select: bool = False) -> dict:
    from engine.attention_paths import AttentionPaths
    from engine.decode_graphs import DecodeGraphRunner, max_width_pages, width_bucket
    from engine.kv_pool import KVPool
    from engine.model_runner import ModelRunner
    from engine.request import Request
    from engine.sampling import SamplingParams
    from kernels.backends.triton_backend import TritonBackend, TritonBlockSelectBackend
    from kernels.kv_layout import bytes_per_token_per_layer

    pages_per_seq = math.ceil((seq_len + 1) / PAGE)
    num_pages = batch * pages_per_seq
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
    backend = TritonBlockSelectBackend() if block_select else TritonBackend()
    paths = AttentionPaths(pool, backend, PAGE, cfg.num_attention_heads, cfg.head_dim ** -0.5, device)
    graphs = DecodeGraphRunner(model, paths, device, max(batch, 1), max_width_pages(seq_len + 64, PAGE), True)
    runner = ModelRunner(model, paths, device, graphs)
    sp = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    reqs = []
    for i in range(batch):
        r = Request(f"r{i}", [1] * seq_len, sp, page_ids=list(range(i * pages_per_seq, (i + 1) * pages_per_seq)))
        r.kv_len = seq_len - 1  # the step writes token seq_len-1 and attends over seq_len tokens
        reqs.append(r)
    out = {"kv_dtype": kv_dtype, "batch": batch, "seq_len": seq_len, "pool_gib": pool_bytes / 2**30}
    t0 = time.perf_counter()
    runner.decode_logits(reqs)  # captures the graph of this bucket
    out["capture_s"] = time.perf_counter() - t0
    out["graph_ms"] = _time_ms(lambda: runner.decode_logits(reqs), iters)
    out["eager_ms"] = _time_ms(lambda: runner.decode_logits(reqs, use_graphs=False), max(3, iters // 3))
    out.update(attention_times(paths, batch, seq_len, pages_per_seq, width_bucket(pages_per_seq, graphs.max_width),
                               iters, device))
    kv_bytes = batch * seq_len * per_token
    out["kv_read_gb"] = kv_bytes / 1e9
    out["attention_tb_s"] = kv_bytes / (out["attention_graph_ms"] * 1e-3) / 1e12
    out["tok_s"] = batch / (out["graph_ms"] * 1e-3)
    out["non_attention_ms"] = out["graph_ms"] - out["attention_graph_ms"]
    out["weight_gb"] = weight_bytes_per_step(model, batch) / 1e9
    if profile:
        out.update(step_profile(lambda: runner.decode_logits(reqs),
                                lambda: runner.decode_logits(reqs, use_graphs=False), out["graph_ms"], out["eager_ms"]))
    return out  # the pool and graphs are freed with this frame; main() empties the cache


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
    p.add_argument("--profile", action="store_true",
                   help="also profile each shape's graph replay (torch profiler): top kernels, kernel time per "
                        "category and the launch gaps (graph step - kernel sum)")
    p.add_argument("--out", default="docs/benchmarks/engine_decode.json")
    p.add_argument("--md", default=None, help="also write the table as markdown here")
    p.add_argument("--render", default=None, metavar="JSON", help="only render --md from an earlier JSON")
    a = p.parse_args(argv)
    if a.block_select and set(a.kv_dtypes) != {"nvfp4"}:
        p.error("--block-select changes only nvfp4 pool writes: give --kv-dtypes nvfp4")
    if len(set(a.kv_rotations)) != len(a.kv_rotations) or a.kv_rotations[1:].count("none"):
        p.error("--kv-rotations: each once, none (if given) first")
    if a.render:
        with open(a.render) as f:
            doc = json.load(f)
        _write_md(doc, a.md or a.render.removesuffix(".json") + ".md")
        return 0
    if not torch.cuda.is_available():
        raise SystemExit("bench_decode_step needs a CUDA GPU")
    dev = torch.device("cuda")
    max_len = max(l for _, l in a.shapes) + 128
    model, cfg = build_model(a.layers, max_len, dev, fused_ops=not a.no_fused)
    bw = copy_bandwidth(dev)
    rows = []
    for rotation in a.kv_rotations:
        if rotation != "none":
            from engine.kv_rotation import head_rotation

            model.rotate_kv(head_rotation(rotation, cfg.head_dim, dev, model.dtype))
        for b, l in a.shapes:
            for dt in a.kv_dtypes:
                try:
                    row = run_shape(model, cfg, dt, b, l, a.iters, dev, a.profile, a.block_select)
                except Exception as e:  # noqa: BLE001 - recorded, the other shapes go on
                    traceback.print_exc()
                    row = {"kv_dtype": dt, "batch": b, "seq_len": l, "error": f"{type(e).__name__}: {e}"}
                    torch.cuda.empty_cache()
                row["kv_rotation"] = rotation
                if "weight_gb" in row:
                    row["non_attention_floor_ms"] = row["weight_gb"] / bw
                rows.append(row)
                torch.cuda.empty_cache()
                _log(json.dumps(row))
    _print_table(rows, a.layers)
    doc = {"gpu": torch.cuda.get_device_name(dev), "copy_tb_s": bw, "layers": a.layers, "fused_ops": not a.no_fused,
           "block_select": a.block_select, "kv_rotations": a.kv_rotations,
           "model": "Qwen3-8B-shaped, random bf16 weights", "command": " ".join(["python -m benchmarks.engine.bench_decode_step", *sys.argv[1:]]), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {a.out}")
    if a.md:
        _write_md(doc, a.md)
    return 0


_COLUMNS_DOC = (
    "One whole decode step (`ModelRunner.decode_logits`: every layer, K/V write, attention, logits) over B "
    "sequences of L cached tokens; the pool holds random valid K/V bytes (no prefill). `graph` = the step replayed "
    "as a CUDA graph, `eager` = the same step without graphs. `attention (graph)` = the decode of all layers alone "
    "(no model, no K/V write) over the same pages, the loop over layers captured as one CUDA graph on a static plan "
    "of the step's table width, as the step's graph runs it (TB/s = K/V bytes of the dtype / that time); "
    "`attention (eager loop)` = the same loop launched from Python layer after layer: at small batches it times "
    "the host, not the kernels. fp8/bf16 attention is FlashInfer's decode, nvfp4 ours. `rest` = graph - attention "
    "(graph): everything else in the step (matmuls, norms, activations, RoPE, K/V write, logits, the staging of "
    "the step's inputs before the replay); `floor` = the weight bytes of one step at the copy bandwidth. `-`: not "
    "measured in this JSON (earlier runs timed the attention as the eager loop only).")
_PROFILE_DOC = (
    "Kernel times of the step (`--profile`: torch profiler, 3 steps averaged) summed by kernel name, in ms per "
    "step: GEMM = the cuBLAS matmuls incl. their split-K reduces (projections, MLP, logits); attention = the "
    "decode kernels and their split-KV merge; K/V write = the pool write of the step's token; norms + rope + "
    "activation = the fused Triton kernels (with --no-fused their PyTorch kernels count as other); other = the "
    "rest (embedding, the copies of the step's inputs, elementwise ops). `launch gaps` = step ms - kernel sum: "
    "the time the GPU runs none of the step's kernels (the host's staging before the replay, the gaps between "
    "kernels). Kernels of a CUDA graph replay, measured against `graph ms`; rows marked eager: the profiler saw no "
    "kernel inside the replay, so these are the eager step's kernels against `eager ms`.")


def _write_md(doc: dict, path: str) -> None:
    rows = doc["rows"]
    fp8 = _fp8_rows(rows)
    lines = [
        f"# Engine decode step ({doc['gpu']}, {doc['model']}, {doc['layers']} layers)", "",
        (f"Command: `{doc['command']}`. Copy bandwidth measured: {doc['copy_tb_s']:.2f} TB/s. Decoder norms, "
        f"activation and RoPE: {'fused Triton kernels' if doc.get('fused_ops', True) else 'PyTorch ops'}."
        + (" NVFP4 pool writes: the per-block scale search (triton-block-select)." if doc.get("block_select") else "")),
        "", _COLUMNS_DOC, "",
        ("| B x L | kv | graph ms | eager ms | attention ms (graph) | attention ms (eager loop) | attention TB/s "
         "| rest ms | floor ms | rest / floor | tok/s | vs fp8 |"),
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        shape = f"{r['batch']} x {r['seq_len']}"
        if "error" in r:
            lines.append(f"| {shape} | {_kv(r)} | {r['error']} | | | | | | | | | |")
            continue
        c = _cells(r, fp8.get((r["batch"], r["seq_len"])))
        lines.append(f"| {shape} | {_kv(r)} | {c['graph']} | {c['eager']} | {c['attn']} | {c['attn_eager']} | "
                     f"{c['tb_s']} | {c['rest']} | {c['floor']} | {c['over']} | {c['tok_s']} | {c['vs_fp8']} |")
    lines += _rotation_lines(rows)
    lines += _category_lines(rows)
    lines += _kernel_lines(rows)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"wrote {path}")


def _kv(r: dict) -> str:
    """The row's cache dtype, with its --kv-rotation where it has one."""
    rot = r.get("kv_rotation", "none")
    return r["kv_dtype"] if rot == "none" else f"{r['kv_dtype']} + {rot}"


def _fp8_rows(rows: list[dict]) -> dict[tuple[int, int], dict]:
    return {(r["batch"], r["seq_len"]): r for r in rows
            if r["kv_dtype"] == "fp8_e4m3" and r.get("kv_rotation", "none") == "none" and "tok_s" in r}


def _rotation_lines(rows: list[dict]) -> list[str]:
    """Each rotated row's step against the unrotated row of its dtype and shape in the same run."""
    plain = {(r["kv_dtype"], r["batch"], r["seq_len"]): r for r in rows
             if r.get("kv_rotation", "none") == "none" and "graph_ms" in r}
    pairs = [(r, plain[(r["kv_dtype"], r["batch"], r["seq_len"])]) for r in rows
             if r.get("kv_rotation", "none") != "none" and "graph_ms" in r
             and (r["kv_dtype"], r["batch"], r["seq_len"]) in plain]
    if not pairs:
        return []
    out = ["", "### The rotation's cost per step (same run)", "",
           ("| B x L | kv | step ms unrotated | step ms rotated | rotated / unrotated | attention ms unrotated "
            "| attention ms rotated |"), "|---|---|---|---|---|---|---|"]
    for r, p in pairs:
        out.append(f"| {r['batch']} x {r['seq_len']} | {_kv(r)} | {p['graph_ms']:.3f} | {r['graph_ms']:.3f} | "
                   f"{r['graph_ms'] / p['graph_ms']:.3f} | {p['attention_graph_ms']:.3f} | "
                   f"{r['attention_graph_ms']:.3f} |")
    return out


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _cells(r: dict, fp8_row: dict | None) -> dict[str, str]:
    """One measured row's table cells. Rows of older JSONs have ``attention_ms`` (the eager loop) only."""
    attn = r.get("attention_graph_ms")
    rest = None if attn is None else r["graph_ms"] - attn
    floor = r.get("non_attention_floor_ms")
    return {"graph": _ms(r["graph_ms"]), "eager": _ms(r["eager_ms"]), "attn": _ms(attn),
            "attn_eager": _ms(r.get("attention_eager_ms", r.get("attention_ms"))),
            "tb_s": "-" if attn is None else f"{r['kv_read_gb'] / attn:.2f}", "rest": _ms(rest), "floor": _ms(floor),
            "over": "-" if rest is None or not floor else f"{rest / floor:.2f}x", "tok_s": f"{r['tok_s']:.0f}",
            "vs_fp8": f"{r['tok_s'] / fp8_row['tok_s']:.2f}x" if fp8_row else "-"}


def _category_lines(rows: list[dict]) -> list[str]:
    """The profiled rows' kernel time per category and launch gaps (``--profile``)."""
    prof = [r for r in rows if r.get("kernel_ms")]
    if not prof:
        return []
    names = [CATEGORY_NAMES[c] for c in CATEGORY_NAMES]
    out = ["", "### Where a step's time goes (kernel ms per step)", "", _PROFILE_DOC, "",
           "| B x L | kv | step ms | " + " | ".join(names) + " | kernel sum | launch gaps |",
           "|---|---|---|" + "---|" * (len(names) + 2)]
    for r in prof:
        cats, eager = r["kernel_ms"], r.get("kernels_from") == "eager"
        step = f"{r['eager_ms']:.2f} (eager)" if eager else f"{r['graph_ms']:.2f}"
        out.append(f"| {r['batch']} x {r['seq_len']} | {_kv(r)} | {step} | "
                   + " | ".join(f"{cats[c]:.2f}" for c in CATEGORY_NAMES)
                   + f" | {cats['total']:.2f} | {r['launch_gaps_ms']:.2f} |")
    return out


def _kernel_lines(rows: list[dict]) -> list[str]:
    """Per profiled shape: its top kernels (``--profile``), of a graph replay or, in older JSONs, an eager step."""
    out = []
    for r in rows:
        if not r.get("kernels"):
            continue
        source = "CUDA graph replay" if r.get("kernels_from") == "graph" else "eager step"
        title = f"### Kernels of one step: {r['batch']} x {r['seq_len']}, {_kv(r)} (torch profiler, {source})"
        out += ["", title, "", "| kernel | us per step | launches per step |", "|---|---|---|"]
        out += [f"| `{k['kernel']}` | {k['us']:.1f} | {k['launches']:.0f} |" for k in r["kernels"]]
    return out


def _print_table(rows: list[dict], layers: int) -> None:
    print(f"\nengine decode step, Qwen3-8B-shaped, {layers} layers (attention: the decode of all layers in one "
          "CUDA graph; rest = graph - attention)")
    heads = ("graph ms", "eager ms", "attn ms", "attn eager", "attn TB/s", "rest ms", "floor ms", "x floor", "tok/s",
             "vs fp8")
    print(f"{'shape':>12} {'kv':>9} " + " ".join(f"{h:>10}" for h in heads))
    fp8 = _fp8_rows(rows)
    for r in rows:
        shape = f"{r['batch']}x{r['seq_len']}"
        if "error" in r:
            print(f"{shape:>12} {_kv(r):>9}  {r['error']}")
            continue
        c = _cells(r, fp8.get((r["batch"], r["seq_len"])))
        keys = ("graph", "eager", "attn", "attn_eager", "tb_s", "rest", "floor", "over", "tok_s", "vs_fp8")
        print(f"{shape:>12} {_kv(r):>9} " + " ".join(f"{c[k]:>10}" for k in keys))


if __name__ == "__main__":
    raise SystemExit(main())
