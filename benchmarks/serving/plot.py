"""PNG figures from results files: throughput vs concurrency, the Pareto curve, TTFT vs concurrency.

Points are grouped into series by (kv dtype, input length, output length) over all files given, so one
sweep per KV dtype gives one line per dtype. Needs matplotlib (``pip install -e ".[bench]"``).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.serving.report import read_json

FIGURES = ("throughput_vs_concurrency.png", "pareto.png", "ttft_vs_concurrency.png")
_DTYPE_ORDER = {"bf16": 0, "fp8_e4m3": 1, "nvfp4": 2}


def _matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise RuntimeError('plot needs matplotlib: pip install -e ".[bench]" (or: pip install matplotlib)') \
            from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def series(docs: Sequence[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """label -> points sorted by concurrency; the label is the kv dtype, plus the lengths when they differ."""
    groups: dict[tuple[str, int, int], list[dict[str, Any]]] = {}
    for doc in docs:
        dtype = doc["deployment"].get("kv_dtype") or "?"
        for p in doc["points"]:
            p = {**p, "_num_gpus": doc.get("num_gpus", 1)}
            groups.setdefault((dtype, p["input_len"], p["output_len"]), []).append(p)
    lengths = {(i, o) for _, i, o in groups}
    out = {}
    for (dtype, i, o) in sorted(groups, key=lambda k: (_DTYPE_ORDER.get(k[0], 9), k[0], k[1], k[2])):
        label = dtype if len(lengths) == 1 else f"{dtype} {i}/{o}"
        out[label] = sorted(groups[(dtype, i, o)], key=lambda p: p["concurrency"])
    return out


def _title(docs: Sequence[dict[str, Any]]) -> str:
    """Model, layers, lengths (when every point shares them) and GPU of the first file."""
    dep = docs[0]["deployment"]
    layers = f"{dep['num_layers']} layers" + (" (override)" if dep.get("num_layers_note") else "")
    lengths = {(p["input_len"], p["output_len"]) for d in docs for p in d["points"]}
    io = f", in/out {'/'.join(map(str, next(iter(lengths))))}" if len(lengths) == 1 else ""
    return f"{dep['model']}, {layers}{io}, {docs[0]['gpu']}"


def plot(paths: Sequence[str | Path], out_dir: str | Path, prefix: str = "") -> list[Path]:
    """Draw the three figures of the results files ``paths`` into ``out_dir``; returns the PNG paths."""
    plt = _matplotlib()
    docs = [read_json(p) for p in paths]
    docs = [d for d in docs if d["points"]]
    if not docs:
        raise ValueError("the results files hold no points")
    lines = series(docs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written = []

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in lines.items():
        c = [p["concurrency"] for p in pts]
        line = ax.plot(c, [p["output_tok_s"] for p in pts], marker="o", label=f"{label} output")[0]
        peak = [(p["concurrency"], p["peak_decode_tok_s"]) for p in pts if p["peak_decode_tok_s"] is not None]
        if peak:
            ax.plot(*zip(*peak, strict=True), marker="^", linestyle="--", color=line.get_color(),
                    label=f"{label} peak-batch decode")
    _finish(ax, "concurrency", "tokens/s", _title(docs), log_x=True)
    written.append(_save(fig, out / f"{prefix}{FIGURES[0]}"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in lines.items():
        pts = [p for p in pts if p["tok_s_per_user"] is not None]
        x = [p["tok_s_per_user"] for p in pts]
        y = [p["output_tok_s"] / p["_num_gpus"] for p in pts]
        ax.plot(x, y, marker="o", label=label)
        for p, xi, yi in zip(pts, x, y, strict=True):
            ax.annotate(str(p["concurrency"]), (xi, yi), textcoords="offset points", xytext=(4, 4),
                        fontsize=7)
    _finish(ax, "tokens/s per user (1 / median TPOT)", "output tokens/s per GPU",
            _title(docs) + "; labels: concurrency")
    written.append(_save(fig, out / f"{prefix}{FIGURES[1]}"))

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, pts in lines.items():
        c = [p["concurrency"] for p in pts]
        line = ax.plot(c, [p["ttft_ms"]["median"] for p in pts], marker="o", label=f"{label} median")[0]
        ax.plot(c, [p["ttft_ms"]["p99"] for p in pts], marker="x", linestyle="--", color=line.get_color(),
                label=f"{label} p99")
    _finish(ax, "concurrency", "TTFT (ms)", _title(docs), log_x=True)
    written.append(_save(fig, out / f"{prefix}{FIGURES[2]}"))
    return written


def _finish(ax: Any, xlabel: str, ylabel: str, title: str, log_x: bool = False) -> None:
    if log_x:
        ax.set_xscale("log", base=2)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)


def _save(fig: Any, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _matplotlib().close(fig)
    return path
