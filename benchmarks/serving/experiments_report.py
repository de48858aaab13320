"""The markdown report and plots of ``nvfp4-serve bench experiments`` (docs/benchmarks/README.md).

``summarize(doc)`` reads the ratios off the results document: decode throughput is the peak-batch figure
(``stats``; the full-batch mean beside it), NVFP4 over FP8 and over BF16, at iso-concurrency (the same C for
every dtype) and at iso-capacity (each dtype at the largest C its pool holds, whose ratio is the max
concurrency ratio); the TTFT overhead is NVFP4's mean TTFT over FP8's at iso-concurrency, minus 1. The
design targets are checked at ``plan.target_input_len`` / ``plan.output_len``.

Regenerate the report from a results file (no GPU needed):
``python -m benchmarks.serving.experiments_report docs/benchmarks/serving.json [--report README.md]``
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.serving.report import fmt_number, write_json
from svc_common.cli_help import HelpFormatter

DTYPE_ORDER = ("bf16", "fp8_e4m3", "nvfp4")
# Gains of NVFP4 over FP8 decode throughput reported for this design elsewhere (the reference column), for comparison.
REFERENCE_GAINS = {"iso_concurrency": (1.26, 1.30), "iso_capacity": (1.37, 1.78)}
# (name, experiment, figure, goal, direction): "ge" needs measured >= goal, "le" measured <= goal.
TARGETS = (
    ("NVFP4/FP8 peak-batch decode throughput at iso-concurrency", "iso_concurrency", "decode_nvfp4_fp8", 1.5, "ge"),
    ("NVFP4/FP8 max concurrency at iso-capacity", "iso_capacity", "concurrency_nvfp4_fp8", 1.75, "ge"),
    ("NVFP4/FP8 peak-batch decode throughput at iso-capacity", "iso_capacity", "decode_nvfp4_fp8", 2.0, "ge"),
    ("TTFT overhead of NVFP4 over FP8 at iso-concurrency (mean, %)", "iso_concurrency", "ttft_overhead_pct",
     1.0, "le"),
)
BARS_FIGURE = "decode_throughput.png"  # after the prefix: the results JSON's stem + "_" (serving.json -> serving_)
_TITLES = {"iso_concurrency": "Iso-concurrency", "iso_capacity": "Iso-capacity", "sweep": "Pareto sweep"}


def _measured(p: dict[str, Any]) -> bool:
    return p["status"] in ("ok", "partial")


def _ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or not b > 0:
        return None
    return a / b


def _by_length(doc: dict[str, Any], experiment: str) -> dict[int, dict[str, dict[str, Any]]]:
    """input length -> dtype -> its (measured) point of ``experiment`` (iso and capacity: one per length)."""
    out: dict[int, dict[str, dict[str, Any]]] = {}
    for d in doc["deployments"]:
        for p in d["points"]:
            if p["experiment"] == experiment and _measured(p):
                out.setdefault(p["input_len"], {})[p["kv_dtype"]] = p
    return out


def _group_summary(points: dict[str, dict[str, Any]]) -> dict[str, Any]:
    nv, fp8, bf16 = points.get("nvfp4"), points.get("fp8_e4m3"), points.get("bf16")

    def get(p: dict[str, Any] | None, key: str) -> float | None:
        return None if p is None else p.get(key)

    def ttft(p: dict[str, Any] | None, stat: str) -> float | None:
        return None if p is None else p["ttft_ms"][stat]

    out: dict[str, Any] = {"concurrency": {k: p["concurrency"] for k, p in points.items()}}
    out["same_concurrency"] = len(set(out["concurrency"].values())) <= 1
    for name, other in (("fp8", fp8), ("bf16", bf16)):
        out[f"decode_nvfp4_{name}"] = _ratio(get(nv, "peak_decode_tok_s"), get(other, "peak_decode_tok_s"))
        out[f"full_batch_decode_nvfp4_{name}"] = _ratio(get(nv, "full_batch_decode_tok_s"),
                                                        get(other, "full_batch_decode_tok_s"))
        out[f"concurrency_nvfp4_{name}"] = _ratio(get(nv, "concurrency"), get(other, "concurrency"))
    for stat in ("mean", "median"):
        r = _ratio(ttft(nv, stat), ttft(fp8, stat))
        out[f"ttft_overhead_pct{'' if stat == 'mean' else '_median'}"] = None if r is None else (r - 1) * 100
    return out


def summarize(doc: dict[str, Any]) -> dict[str, Any]:
    """Ratios per (experiment, input length) and the design targets (JSON-able)."""
    plan = doc["plan"]
    out: dict[str, Any] = {}
    for experiment in ("iso_concurrency", "iso_capacity"):
        groups = _by_length(doc, experiment)
        out[experiment] = {str(length): _group_summary(groups[length]) for length in sorted(groups)}
    targets = []
    at = str(plan["target_input_len"])
    for name, experiment, key, goal, direction in TARGETS:
        value = out[experiment].get(at, {}).get(key)
        met = None if value is None else (value >= goal if direction == "ge" else value <= goal)
        targets.append({"name": name, "input_len": plan["target_input_len"], "output_len": plan["output_len"],
                        "value": value, "goal": goal, "direction": direction,
                        "status": "not measured" if met is None else "met" if met else "not met"})
    out["targets"] = targets
    return out


# -- markdown -------------------------------------------------------------------------------------

def _f(value: Any, digits: int = 1) -> str:
    return fmt_number(value, digits)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}x"


def _pct(value: float | None) -> str:
    return "-" if value is None else f"{value:+.2f}%"


def _gain(ratio: float | None) -> str:
    return "-" if ratio is None else f"{(ratio - 1) * 100:+.0f}%"


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    lines = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|").replace("\n", " ") for c in r) + " |" for r in rows]
    return lines


def _pool_usage(p: dict[str, Any]) -> str:
    pool = (p.get("server") or {}).get("pool") or {}
    frac = pool.get("peak_fraction_in_use")
    if frac is None:
        return "-"
    return f"{frac * 100:.1f}% ({pool['peak_pages_in_use']:,}/{pool['pages_total']:,} pages)"


def _point_row(p: dict[str, Any], with_limit: bool) -> list[str]:
    conc = _f(p["concurrency"])
    if with_limit and p.get("capacity"):
        conc += f" ({p['capacity']['limited_by']})"
    head = [f"{p['input_len']:,}/{p['output_len']:,}", conc]
    if not _measured(p):
        return [*head, p["status"], *["-"] * (len(_POINT_HEAD) - 4), p["error"]]
    ttft, itl = p["ttft_ms"], p["itl_ms"]
    return [*head, f"{p['completed']}/{p['failed']}", _f(p["peak_decode_tok_s"]), _f(p["full_batch_decode_tok_s"]),
            _f(p["output_tok_s"]), f"{_f(ttft['mean'])} / {_f(ttft['median'])} / {_f(ttft['p99'])}",
            f"{_f(itl['median'], 2)} / {_f(itl['p99'], 2)}", _pool_usage(p), "; ".join(p.get("errors") or [])]


_POINT_HEAD = ("input/output", "C", "ok/failed", "peak-batch decode tok/s", "full-batch decode tok/s",
               "output tok/s", "TTFT mean / median / p99 ms", "ITL median / p99 ms", "max pool usage", "note")


def _experiment_section(doc: dict[str, Any], experiment: str) -> list[str]:
    lines: list[str] = []
    for d in doc["deployments"]:
        pts = [p for p in d["points"] if p["experiment"] == experiment]
        if not pts:
            continue
        head = list(_POINT_HEAD)
        if experiment == "iso_capacity":
            head[1] = "C (limited by)"
        lines += [f"**{d['kv_dtype']}**", ""]
        lines += _table(head, [_point_row(p, experiment == "iso_capacity") for p in pts]) + [""]
    return lines


def _ratio_section(summary: dict[str, Any], experiment: str) -> list[str]:
    groups = summary[experiment]
    if not groups:
        return ["No measured points of every dtype for ratios.", ""]
    rows = []
    for length, g in groups.items():
        conc = ", ".join(f"{k} {v}" for k, v in g["concurrency"].items())
        if experiment == "iso_concurrency" and not g["same_concurrency"]:
            conc += " (NOT iso: the concurrencies differ)"
        row = [f"{int(length):,}", conc,
               f"{_x(g['decode_nvfp4_fp8'])} ({_x(g['full_batch_decode_nvfp4_fp8'])})",
               f"{_x(g['decode_nvfp4_bf16'])} ({_x(g['full_batch_decode_nvfp4_bf16'])})"]
        if experiment == "iso_capacity":
            row += [_x(g["concurrency_nvfp4_fp8"]), _x(g["concurrency_nvfp4_bf16"])]
        else:
            row += [f"{_pct(g['ttft_overhead_pct'])} / {_pct(g['ttft_overhead_pct_median'])}"]
        rows.append(row)
    head = ["input len", "C per dtype", "NVFP4/FP8 decode (full-batch)", "NVFP4/BF16 decode (full-batch)"]
    head += (["NVFP4/FP8 max concurrency", "NVFP4/BF16 max concurrency"] if experiment == "iso_capacity"
             else ["TTFT overhead NVFP4 vs FP8 (mean / median)"])
    return _table(head, rows) + [""]


def _model_lines(doc: dict[str, Any]) -> list[str]:
    ok = [d for d in doc["deployments"] if d.get("deployment")]
    if not ok:
        return ["- No deployment started: see the errors below."]
    dep, layers = ok[0]["deployment"], ok[0].get("num_layers") or {}
    served, checkpoint = dep["num_layers"], layers.get("checkpoint") or dep.get("checkpoint_num_layers")
    if layers.get("override") or (checkpoint and served and served != checkpoint):
        layer_text = f"**{served} of the checkpoint's {checkpoint} layers (`--num-layers {served}` override)**"
    else:
        layer_text = f"{served} layers" + (f" ({dep['num_layers_note']})" if dep.get("num_layers_note") else "")
    gpus = sorted({d["gpu"] for d in ok})
    model = (f"- Model: `{dep['model']}` (`{dep['model_path']}`), {layer_text}; {dep['num_kv_heads']} KV heads "
             f"x head_dim {dep['head_dim']}, page size {dep['page_size']}")
    services = (f"- Deployment: {dep['num_decode_workers']} decode, {dep['num_prefill_workers']} prefill "
                f"service(s); run {doc['created']}")
    return [f"- GPU: {', '.join(gpus)} ({doc['plan']['bench']['num_gpus']} per deployment)", model, services]


def _deployment_rows(doc: dict[str, Any]) -> list[list[str]]:
    rows = []
    for d in doc["deployments"]:
        dep = d.get("deployment") or {}
        pools = dep.get("pool_tokens_per_decode_worker")
        error = d["error"] if len(d["error"]) <= 400 else d["error"][:400] + f" ... (see {d['launch_log']})"
        rows.append([d["kv_dtype"], d["status"], _f(sum(pools)) if pools else "-", _f(d.get("launch_s")),
                     _f(d.get("wall_s")), error or "-"])
    return rows


def render(doc: dict[str, Any], figures: Sequence[str] = (), figures_note: str = "",
           others: Sequence[str] = ()) -> str:
    """The report's markdown (``figures``: PNG file names beside it; ``others``: other reports to link)."""
    summary = summarize(doc)
    plan = doc["plan"]
    intro = ("Generated by `nvfp4-serve bench experiments` (`benchmarks/serving/experiments_report.py`) from "
             "[`serving.json`](serving.json); do not edit by hand. Decode throughput is the *peak-batch* figure "
             f"(the best {plan['bench']['peak_window_s']:g} s window while every request of the point decodes, "
             "see `benchmarks/serving/stats.py`), the full-batch mean beside it in parentheses; every request "
             "has exactly the input and output length shown.")
    lines = [f"# Serving benchmark: KV cache {' vs '.join(plan['kv_dtypes'])}", "", intro, "",
             *_model_lines(doc), "", "Command:", "", "```", doc["command"], "```", ""]
    if any(t["value"] is not None for t in summary["targets"]):  # a run without the target's points omits them
        lines += ["## Design targets", ""]
        rows = [[t["name"], f"{t['input_len']:,}/{t['output_len']:,}",
                 _pct(t["value"]) if t["direction"] == "le" else _x(t["value"]),
                 (f"<= {t['goal']:g}%" if t["direction"] == "le" else f">= {t['goal']:g}x"), t["status"]]
                for t in summary["targets"]]
        lines += _table(["target", "input/output", "measured", "goal", "status"], rows) + [""]
    lines += ["## Comparison with the reference gains (NVFP4 over FP8 decode throughput)", ""]
    rows = []
    for experiment, label in (("iso_concurrency", "equal concurrency"), ("iso_capacity", "equal memory")):
        lo, hi = REFERENCE_GAINS[experiment]
        here = ", ".join(f"{int(length):,}: {_gain(g['decode_nvfp4_fp8'])}"
                         for length, g in summary[experiment].items()) or "-"
        rows.append([label, f"+{(lo - 1) * 100:.0f}% to +{(hi - 1) * 100:.0f}%", here])
    lines += _table(["comparison", "reference", "here (by input length)"], rows) + [""]
    for experiment in ("iso_concurrency", "iso_capacity", "sweep"):
        if not any(p["experiment"] == experiment for p in plan["points"]):
            continue
        title = _TITLES[experiment]
        if experiment == "sweep":
            title += f" (input {plan['sweep_input_len']:,}, output {plan['output_len']:,})"
        lines += [f"## {title}", ""]
        if experiment != "sweep":
            lines += _ratio_section(summary, experiment)
        lines += _experiment_section(doc, experiment)
    lines += ["## Plots", ""]
    lines += [f"![{name}]({name})" for name in figures] or [figures_note or "No plots."]
    lines += ["", "## Deployments", ""]
    lines += _table(["kv dtype", "status", "pool tokens (decode)", "start s", "wall s", "error"],
                    _deployment_rows(doc)) + [""]
    failed = [p for d in doc["deployments"] for p in d["points"] if p["status"] not in ("ok",)]
    if failed:
        lines += ["## Points not measured cleanly", ""]
        lines += _table(["kv dtype", "experiment", "input len", "C", "status", "error"],
                        [[p["kv_dtype"], p["experiment"], _f(p["input_len"]), _f(p["concurrency"]), p["status"],
                          p["error"] or "; ".join(p.get("errors") or [])] for p in failed]) + [""]
    if others:
        lines += ["## Other benchmarks", "", *(f"- [{name}]({name})" for name in others), ""]
    return "\n".join(lines)


# -- plots ------------------------------------------------------------------------------------------

def _curve_docs(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One plot.py results document per dtype: every measured point at the sweep's lengths (sweep first)."""
    plan = doc["plan"]
    out = []
    for d in doc["deployments"]:
        pts: dict[int, dict[str, Any]] = {}
        for p in sorted(d["points"], key=lambda p: p["experiment"] != "sweep"):
            if _measured(p) and (p["input_len"], p["output_len"]) == (plan["sweep_input_len"], plan["output_len"]):
                pts.setdefault(p["concurrency"], p)
        if pts:
            out.append({"deployment": d["deployment"], "gpu": d["gpu"], "num_gpus": plan["bench"]["num_gpus"],
                        "points": sorted(pts.values(), key=lambda p: p["concurrency"])})
    return out


def _bars(doc: dict[str, Any], path: Path) -> Path | None:
    """Peak-batch decode throughput per dtype at every iso-concurrency and iso-capacity point."""
    from benchmarks.serving.plot import _matplotlib

    groups = [(f"iso-C {length:,}", pts) for length, pts in sorted(_by_length(doc, "iso_concurrency").items())]
    groups += [(f"iso-capacity {length:,}", pts) for length, pts in sorted(_by_length(doc, "iso_capacity").items())]
    dtypes = [d for d in DTYPE_ORDER if any(d in pts for _, pts in groups)]
    if not groups or not dtypes:
        return None
    plt = _matplotlib()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    width = 0.8 / len(dtypes)
    for i, dtype in enumerate(dtypes):
        xs = [g + (i - (len(dtypes) - 1) / 2) * width for g in range(len(groups))]
        ys = [(pts.get(dtype) or {}).get("peak_decode_tok_s") or 0.0 for _, pts in groups]
        bars = ax.bar(xs, ys, width, label=dtype)
        labels = [f"C={pts[dtype]['concurrency']}" if dtype in pts else "" for _, pts in groups]
        ax.bar_label(bars, labels=labels, fontsize=7)
    ax.set_xticks(range(len(groups)), [name for name, _ in groups], fontsize=8)
    ax.set_ylabel("peak-batch decode tokens/s")
    dep = next(d["deployment"] for d in doc["deployments"] if d.get("deployment"))
    gpu = next(d["gpu"] for d in doc["deployments"] if d.get("gpu"))
    ax.set_title(f"{dep['model']}, {dep['num_layers']} layers, {gpu}; output {doc['plan']['output_len']:,} "
                 "tokens; labels: concurrency", fontsize=9)
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def draw_figures(doc: dict[str, Any], out_dir: str | Path, prefix: str = "serving_") -> tuple[list[Path], str]:
    """(PNG paths written into ``out_dir``, each name starting with ``prefix``; "" or why none were drawn)."""
    from benchmarks.serving.plot import plot

    out_dir = Path(out_dir)
    written: list[Path] = []
    try:
        curves = _curve_docs(doc)
        if curves:
            with tempfile.TemporaryDirectory() as tmp:
                paths = []
                for i, c in enumerate(curves):
                    paths.append(Path(tmp) / f"{i}.json")
                    paths[-1].write_text(json.dumps(c))
                written += plot(paths, out_dir, prefix)
        out_dir.mkdir(parents=True, exist_ok=True)
        bars = _bars(doc, out_dir / f"{prefix}{BARS_FIGURE}")
        if bars is not None:
            written.insert(0, bars)
    except RuntimeError as exc:  # matplotlib missing
        return [], f"No plots: {exc}."
    return written, "" if written else "No plots: no measured point."


def write_report(doc: dict[str, Any], json_path: str | Path, report_path: str | Path) -> Path:
    """Draw the figures beside ``report_path`` and write the markdown there."""
    report_path = Path(report_path)
    figures, note = draw_figures(doc, report_path.parent, f"{Path(json_path).stem}_")
    others = sorted(p.name for p in report_path.parent.glob("*.md") if p.name != report_path.name)
    text = render(doc, [f.name for f in figures], note, others)
    json_name = Path(json_path).name
    if json_name != "serving.json":
        text = text.replace("[`serving.json`](serving.json)", f"[`{json_name}`]({json_name})")
    report_path.parent.mkdir(parents=True, exist_ok=True)
    report_path.write_text(text)
    return report_path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser("python -m benchmarks.serving.experiments_report", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("results", help="results JSON of nvfp4-serve bench experiments")
    p.add_argument("--report", default=None, help="markdown path (default: README.md beside the results)")
    a = p.parse_args(argv)
    doc = json.loads(Path(a.results).read_text())
    if doc.get("schema") != "nvfp4-serve/bench-experiments/1":
        print(f"{a.results} is not a results file of nvfp4-serve bench experiments", file=sys.stderr)
        return 1
    doc["summary"] = summarize(doc)
    write_json(doc, a.results)
    path = write_report(doc, a.results, a.report or Path(a.results).with_name("README.md"))
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
