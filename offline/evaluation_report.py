"""The accuracy report: markdown tables and plain findings from ``offline.evaluation``'s results."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from offline.synthetic_kv import SYNTHETIC_FORMATS


def mean_se(per_window: torch.Tensor) -> tuple[float, float]:
    """Mean and its standard error over windows (predictions inside a window are correlated)."""
    n = per_window.numel()
    se = float(per_window.std() / math.sqrt(n)) if n > 1 else float("nan")
    return float(per_window.mean()), se


def _change(before: dict[str, Any], after: dict[str, Any]) -> str:
    """KL before -> after, relative change, and the paired per-window difference ± its std error."""
    b, a = before["kl_vs_bf16"], after["kl_vs_bf16"]
    diff, se = mean_se(torch.tensor(after["kl_per_window"]) - torch.tensor(before["kl_per_window"]))
    rel = f" ({(a - b) / b * 100:+.0f}%)" if b > 0 else ""
    verdict = "more than" if abs(diff) > 2 * se else "within"
    return f"{b:.2e} -> {a:.2e}{rel}, paired difference {diff:+.1e} ± {se:.1e} ({verdict} 2 standard errors)"


def findings(results: dict[str, Any]) -> list[str]:
    """Plain statements read off the numbers (no judgement beyond the sign and size of each change)."""
    lines = []
    cal = results["calibration"]
    for c in results["contexts"]:
        v = {r["variant"]: r for r in c["rows"]}
        f1, fc = v.get("fp8_e4m3 (scale 1.0)"), v.get("fp8_e4m3 calibrated")
        n1, nc = v.get("nvfp4 (scale 1.0)"), v.get("nvfp4 calibrated")
        nb = v.get("nvfp4 calibrated + block select")
        npool = v.get("nvfp4 calibrated pool, workspace 1.0")
        if n1 and nc:
            lines.append(
                f"{c['name']} context ({c['context_len']} tokens): calibration moves NVFP4's KL vs bf16 "
                f"{_change(n1, nc)}, perplexity {n1['perplexity']:.4f} -> "
                f"{nc['perplexity']:.4f}."
            )
        if n1 and npool:
            lines.append(
                f"{c['name']} context: calibrating only the NVFP4 pool's global scales (FP8 workspace at "
                f"1.0) moves NVFP4's KL {_change(n1, npool)}."
            )
        if f1 and fc:
            lines.append(f"{c['name']} context: calibration moves FP8's KL vs bf16 {_change(f1, fc)}.")
        if n1 and nc and f1 and fc and f1["kl_vs_bf16"] > 0 and fc["kl_vs_bf16"] > 0:
            lines.append(
                f"{c['name']} context: NVFP4/FP8 KL ratio {n1['kl_vs_bf16'] / f1['kl_vs_bf16']:.1f}x "
                f"with scale 1.0, {nc['kl_vs_bf16'] / fc['kl_vs_bf16']:.1f}x calibrated."
            )
        if nc and nb:
            lines.append(
                f"{c['name']} context: per-block scale selection moves calibrated NVFP4's KL "
                f"{_change(nc, nb)}, perplexity {nc['perplexity']:.4f} -> "
                f"{nb['perplexity']:.4f}."
            )
        lines += _rotation_findings(c["name"], v)
        for key in ("k", "v") if "amax" in c else ():
            pairs = zip(c["amax"][key], cal[f"{key}_amax"])
            over = {i: seen / calib - 1 for i, (seen, calib) in enumerate(pairs) if seen > calib > 0}
            if over:
                lines.append(
                    f"{c['name']} context: {key.upper()} amax of the evaluated windows exceeds the "
                    f"calibration amax in layers {list(over)} (by up to {max(over.values()):+.0%}): with "
                    "calibrated scales those values saturate (FP8 at 448 * s, NVFP4 at 6 * 448 * g)."
                )
    return lines + _synthetic_findings(results.get("synthetic_attention_error", []))


def _synthetic_findings(rows: list[dict[str, Any]]) -> list[str]:
    """What the rotation moves in each synthetic regime (attention-output error of calibrated NVFP4)."""
    plain, rotated = "nvfp4 calibrated", "nvfp4 calibrated + rotation"
    parts = [f"{r['regime'].split(' (')[0]}: {r[plain]:.3f} -> {r[rotated]:.3f}" for r in rows
             if plain in r and rotated in r]
    if not parts:
        return []
    return ["synthetic K/V: rotation moves calibrated NVFP4's attention-output error " + ", ".join(parts) + "."]


def _rotation_findings(context: str, v: dict[str, dict[str, Any]]) -> list[str]:
    """What the rotation moves, and the best NVFP4 variant's KL against FP8's (each with scale 1.0 and calibrated,
    the lower FP8 taken)."""
    lines = []
    nc, nb = v.get("nvfp4 calibrated"), v.get("nvfp4 calibrated + block select")
    nr, nrb = v.get("nvfp4 calibrated + rotation"), v.get("nvfp4 calibrated + rotation + block select")
    n1, n1r = v.get("nvfp4 (scale 1.0)"), v.get("nvfp4 (scale 1.0) + rotation")
    if n1 and n1r:
        lines.append(f"{context} context: rotation moves NVFP4's KL with scale 1.0 {_change(n1, n1r)}.")
    if nc and nr:
        lines.append(f"{context} context: rotation moves calibrated NVFP4's KL {_change(nc, nr)}.")
    if nb and nrb:
        lines.append(f"{context} context: rotation on top of block selection moves NVFP4's KL {_change(nb, nrb)}.")
    fp8 = [r for name, r in v.items() if name.startswith("fp8_e4m3") and r["kl_vs_bf16"] > 0]
    nv = [r for name, r in v.items() if name.startswith("nvfp4")]
    if fp8 and nv:
        best, ref = min(nv, key=lambda r: r["kl_vs_bf16"]), min(fp8, key=lambda r: r["kl_vs_bf16"])
        lines.append(f"{context} context: the best NVFP4 variant ({best['variant']}) has "
                     f"{best['kl_vs_bf16'] / ref['kl_vs_bf16']:.1f}x the KL of the best FP8 ({ref['variant']}).")
    return lines


_METHOD = (
    "Each window is a context prefilled through path 1 (FP8 attention for fp8/nvfp4, K/V quantized into "
    "the pool) followed by teacher-forced decode steps over the pool (path 3): perplexity, KL(bf16 || "
    "variant) and top-1 agreement are over those next-token distributions. Greedy agreement: "
    "`Engine.generate` from the context, common prefix with bf16's continuation / its length (mean), and "
    "the share of windows whose continuation is identical. Standard errors are over windows. A fresh "
    'engine per variant. "calibrated": global scales from `nvfp4-serve calibrate` (nvfp4: amax/2688 for '
    'the pool and amax/448 for the FP8 workspace; fp8: amax/448); "scale 1.0": every global scale 1.0. '
    '"rotation": `--kv-rotation hadamard` (q/k/v rotated by a randomized Hadamard transform before attention '
    "and quantization, the output rotated back), calibrated under the rotation. "
    "Reproduce with `nvfp4-serve eval --json docs/benchmarks/accuracy.json --markdown "
    "docs/benchmarks/accuracy.md`."
)
_SYNTHETIC = (
    "2048 tokens, head_dim 64, 32 queries; K has 4 outlier channels (x12) and 2% outlier tokens (x6), V "
    "heavy-tailed rows and 0.5% spikes (x20), both scaled to the amax of the regime. Relative L2 error of "
    'the attention output against float64 attention on the exact K/V ("calibrated" uses each tensor\'s '
    'own amax; "rotation": q, K and V rotated by the --kv-rotation hadamard matrix before K and V are stored, '
    "the output rotated back)."
)
_TABLE_HEAD = (
    "| KV cache | perplexity | NLL - bf16's (nats) | KL vs bf16 (mean ± se) | KL p99 | top-1 agreement "
    "| greedy agreement | greedy identical |\n|---|---:|---:|---:|---:|---:|---:|---:|"
)


def render_markdown(results: dict[str, Any]) -> str:
    m, d, cal, comp = results["model"], results["data"], results["calibration"], results["compute"]
    model_dir = Path(m["dir"])
    if model_dir.is_absolute() and model_dir.is_relative_to(Path.cwd()):
        model_dir = model_dir.relative_to(Path.cwd())
    model_line = (
        f"Model `{model_dir}` ({m['architecture']}, {m['num_layers']} layers, {m['num_kv_heads']} KV "
        f"heads of {m['head_dim']}, fingerprint `{m['fingerprint']}`), computed on {comp['device']} "
        f"({comp['dtype']} weights, reference attention backend, torch {comp['torch']})."
    )
    data_line = (
        f"Text: {d['source']} ({d['num_tokens']} tokens). Calibration: {cal['num_tokens']} tokens of "
        f"{cal['source']}; K amax per layer {[round(a, 3) for a in cal['k_amax']]}, "
        f"V amax {[round(a, 3) for a in cal['v_amax']]}."
    )
    out = ["# KV-cache accuracy", "", model_line, data_line, "", _METHOD, ""]
    for c in results["contexts"]:
        title = (
            f"## {c['name']} context: {c['context_len']} tokens, {c['num_windows']} windows, "
            f"{c['continuation_tokens']} teacher-forced predictions and {c['greedy_tokens']} greedy tokens "
            "each"
        )
        out += [title, "", _TABLE_HEAD]
        for r in c["rows"]:
            out.append(
                f"| {r['variant']} | {r['perplexity']:.4f} | {r['nll_delta_vs_bf16']:+.4f} ± "
                f"{r['nll_delta_vs_bf16_se']:.4f} | {r['kl_vs_bf16']:.2e} ± {r['kl_vs_bf16_se']:.1e} | "
                f"{r['kl_vs_bf16_p99']:.2e} | {r['top1_agreement']:.4f} | {r['greedy_agreement']:.3f} | "
                f"{r['greedy_identical']:.2f} |"
            )
        out.append("")
    formats = " | ".join(SYNTHETIC_FORMATS)
    out += ["## Attention-output error on synthetic outlier-heavy K/V", "", _SYNTHETIC, ""]
    out += [f"| regime | {formats} |", "|---|" + "---:|" * len(SYNTHETIC_FORMATS)]
    for r in results["synthetic_attention_error"]:
        out.append(f"| {r['regime']} | " + " | ".join(f"{r[f]:.2e}" for f in SYNTHETIC_FORMATS) + " |")
    out += ["", "## Findings (computed from the numbers above)", ""]
    out += [f"- {line}" for line in findings(results)]
    return "\n".join(out) + "\n"
