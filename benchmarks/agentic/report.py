"""Results of ``nvfp4-serve bench --trace`` -> a markdown report and PNG figures.

    nvfp4-serve bench agentic-report results.json... --out docs/benchmarks/agentic.md [--figures-dir DIR]

Every run (one deployment, one KV dtype) of every file is one series. Per dtype the report finds where the
cache gives way: the first concurrency whose radix caches evicted anything (*saturation*), and the first whose
later-turn cache hit rate fell below ``FALLOFF`` x that dtype's best (*fall-off*); then it compares the dtypes
at every concurrency they share: the *crossover* is the lowest concurrency from which NVFP4's output
throughput stays at least ``AHEAD`` x FP8's (below the margin the two are within run-to-run noise). Figures
(need matplotlib): output throughput, tokens/s per user, cache hit rate, and evicted / re-prefilled tokens,
each against concurrency.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from svc_common.cli_help import HelpFormatter

FALLOFF = 0.9
AHEAD = 1.1
FIGURES = ("throughput", "tok_s_per_user", "cache_hit_rate", "evictions")
_DTYPE_ORDER = {"bf16": 0, "fp8_e4m3": 1, "nvfp4": 2}


def read_results(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or "runs" not in doc or "trace" not in doc:
        raise ValueError(f"{path} is not a results file of `nvfp4-serve bench --trace` (no runs)")
    return doc


def series(docs: Sequence[dict[str, Any]]) -> dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]:
    """label -> (run, its points sorted by concurrency); label = kv dtype (numbered when it repeats)."""
    runs = [r for d in docs for r in d["runs"] if r["points"]]
    runs.sort(key=lambda r: (_DTYPE_ORDER.get(r["kv_dtype"], 9), r["kv_dtype"]))
    out: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]] = {}
    for r in runs:
        label = (r["kv_dtype"] or "?") + (f" + host {r['host_cache_size']}" if _has_host_tier(r) else "")
        k = 2
        base = label
        while label in out:
            label, k = f"{base} #{k}", k + 1
        out[label] = (r, sorted(r["points"], key=lambda p: p["concurrency"]))
    return out


def _has_host_tier(run: dict[str, Any]) -> bool:
    from engine.host_cache_size import parse_host_cache_size  # no torch

    size = run.get("host_cache_size")
    return bool(size) and parse_host_cache_size(size).enabled


_HOST_HEAD = ("KV dtype", "host tier", "C", "cache hit t>0", "its ceiling", "re-prefilled tokens", "output tok/s",
              "x same dtype without tier", "host hits (tokens)", "host load / store GB/s")


def _host_tier_section(lines: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]) -> list[str]:
    """Hit rate and throughput per dtype with and without the host tier (only when some run had one)."""
    if not any(_has_host_tier(r) for r, _ in lines.values()):
        return []
    without = {r["kv_dtype"]: {p["concurrency"]: p for p in pts} for r, pts in lines.values()
               if not _has_host_tier(r)}
    rows, tiered = [], {}
    for _, (run, pts) in sorted(lines.items(), key=lambda kv: (_DTYPE_ORDER.get(kv[1][0]["kv_dtype"], 9),
                                                                _has_host_tier(kv[1][0]))):
        on = _has_host_tier(run)
        host = f"{run['host_cache_size']} ({_f(run.get('host_cache_tokens') or 0)} tokens)" if on else "none"
        if on:
            tiered.setdefault(run["kv_dtype"], {p["concurrency"]: p for p in pts})
        for p in pts:
            base = without.get(run["kv_dtype"], {}).get(p["concurrency"])
            ratio = (p["output_tok_s"] / base["output_tok_s"] if on and base and base["output_tok_s"] else None)
            gbps = f"{_f(p.get('host_load_gbps'))} / {_f(p.get('host_store_gbps'))}" if on else "-"
            rows.append([run["kv_dtype"], host, str(p["concurrency"]),
                         _f(p["cache_hit_rate_later_turns"], pct=True), _f(p.get("later_hit_ceiling"), pct=True),
                         _f(p.get("reprefill_tokens")), _f(p["output_tok_s"]), _f(ratio, 2) if on else "-",
                         _f(p.get("host_hit_tokens", 0)) if on else "-", gbps])
    out = ["", "## Host tier", "",
           ("Each KV dtype with and without the host tier (`--host-cache-size`: evicted pages wait in pinned host "
           "memory, block scales included, and come back instead of being prefilled again); *host hits* = "
           "prompt tokens loaded back from it during the point; GB/s = bytes / copy time of the point's host "
           "<-> device copies; *its ceiling* = the share of later-turn prompt tokens an earlier turn computed (whole "
           "pages): the rest is new in its turn, so no cache reaches more; *re-prefilled* = those an earlier turn "
           "computed that had to be computed again."), "", *_table(_HOST_HEAD, rows)]
    fp8, nv = tiered.get("fp8_e4m3"), tiered.get("nvfp4")
    if fp8 and nv and (shared := sorted(set(fp8) & set(nv))):
        c = shared[-1]
        ratio = nv[c]["output_tok_s"] / fp8[c]["output_tok_s"] if fp8[c]["output_tok_s"] else None
        out += ["", (f"With the tier at C={c}: NVFP4 {_f(nv[c]['output_tok_s'])} vs FP8 "
                     f"{_f(fp8[c]['output_tok_s'])} output tok/s ({_f(ratio, 2)}x).")]
    return out


def cache_limits(points: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Where one dtype's cache gives way (see the module docstring); None where it did not in the sweep."""
    rates = [(p["concurrency"], p["cache_hit_rate_later_turns"]) for p in points
             if p["cache_hit_rate_later_turns"] is not None]
    best = max((r for _, r in rates), default=None)
    saturation = next((p["concurrency"] for p in points if p["evicted_pages"] > 0), None)
    falloff = next((c for c, r in rates if best is not None and r < FALLOFF * best), None)
    top = max(points, key=lambda p: p["output_tok_s"], default=None)
    last = points[-1] if points else None
    return {"best_hit_rate": best, "saturation_concurrency": saturation, "falloff_concurrency": falloff,
            "falloff_hit_rate": next((r for c, r in rates if c == falloff), None),
            "peak_throughput_concurrency": top["concurrency"] if top else None,
            "peak_output_tok_s": top["output_tok_s"] if top else None,
            "last_concurrency": last["concurrency"] if last else None,
            "last_output_tok_s": last["output_tok_s"] if last else None}


def _f(value: Any, digits: int = 1, pct: bool = False) -> str:
    if value is None:
        return "-"
    if pct:
        return f"{value:.1%}"
    if isinstance(value, float):
        return f"{value:,.{digits}f}"
    return f"{value:,}" if isinstance(value, int) else str(value)


def _table(head: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "|".join("---:" for _ in head) + "|",
            *("| " + " | ".join(r) + " |" for r in rows)]


def _run_rows(points: Sequence[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for p in points:
        pool = p["server"]["pool"]
        rows.append([
            str(p["concurrency"]), str(p["num_sessions"]),
            f"{p['completed']} / {p['failed']} / {p['turns_not_sent']}",
            _f(p["output_tok_s"]), _f(p["tok_s_per_user"]),
            f"{_f(p['ttft_ms']['median'], 0)} / {_f(p['ttft_ms']['p99'], 0)}",
            f"{_f(p['cache_hit_rate'], pct=True)} / {_f(p['cache_hit_rate_later_turns'], pct=True)}",
            _f(p["reprefill_tokens"]), f"{_f(p['evicted_pages'])} ({_f(p['evicted_tokens'])})",
            _f(p["retractions"]), f"{_f(pool['peak_pages_used'])} / {_f(pool['pages_total'])}",
            "ok" if p["integrity_ok"] else "**FAILED**"])
    return rows


_RUN_HEAD = ("C", "sessions", "turns ok / failed / not sent", "out tok/s", "tok/s per user",
             "TTFT p50 / p99 ms", "cache hit all / t>0", "re-prefilled tokens", "evicted pages (tokens)",
             "retractions", "peak pages used / total", "integrity")


def _limit_line(label: str, lim: dict[str, Any], c_max: int) -> str:
    best = _f(lim["best_hit_rate"], pct=True)
    sat = (f"first evictions at C={lim['saturation_concurrency']}" if lim["saturation_concurrency"]
           else f"no eviction up to C={c_max}")
    if lim["falloff_concurrency"]:
        fall = (f"later-turn cache hit rate below {FALLOFF:.0%} of its best ({best}) from "
                f"C={lim['falloff_concurrency']} ({_f(lim['falloff_hit_rate'], pct=True)})")
    else:
        fall = f"later-turn cache hit rate within {FALLOFF:.0%} of its best ({best}) up to C={c_max}"
    after = ""
    if lim["last_concurrency"] != lim["peak_throughput_concurrency"] and lim["peak_output_tok_s"]:
        drop = 1.0 - lim["last_output_tok_s"] / lim["peak_output_tok_s"]
        after = f", then {_f(lim['last_output_tok_s'])} tok/s at C={lim['last_concurrency']} (-{drop:.0%})"
    return (f"- **{label}**: {sat}; {fall}; peak output throughput {_f(lim['peak_output_tok_s'])} tok/s at "
            f"C={lim['peak_throughput_concurrency']}{after}.")


_VS_HEAD = ("C", "fp8 out tok/s", "nvfp4 out tok/s", "nvfp4 / fp8", "fp8 hit t>0", "nvfp4 hit t>0",
            "fp8 re-prefilled", "nvfp4 re-prefilled", "fp8 tok/s/user", "nvfp4 tok/s/user")


def _versus(fp8: dict[int, dict[str, Any]], nv: dict[int, dict[str, Any]]) -> list[str]:
    """The throughput crossover line and the side-by-side table of the concurrencies both dtypes ran."""
    shared = sorted(set(fp8) & set(nv))
    if not shared:
        return []
    ratios = {c: nv[c]["output_tok_s"] / fp8[c]["output_tok_s"] for c in shared if fp8[c]["output_tok_s"]}
    out = []
    if ratios:
        lo, hi = min(ratios), max(ratios)
        # the crossover: the lowest concurrency from which NVFP4 stays AHEAD x FP8
        ahead = next((c for c in shared if all(ratios.get(x, 0.0) >= AHEAD for x in shared if x >= c)), None)
        tail = (f"NVFP4 stays at least {AHEAD - 1:.0%} ahead from C={ahead} on (the measured crossover)."
                if ahead is not None else f"NVFP4 is not {AHEAD - 1:.0%} ahead at the highest concurrency.")
        out.append(f"- **throughput**: NVFP4 / FP8 = {ratios[lo]:.2f} at C={lo}, {ratios[hi]:.2f} at C={hi}; "
                   + tail)
    rows = []
    for c in shared:
        a, b = fp8[c], nv[c]
        rows.append([str(c), _f(a["output_tok_s"]), _f(b["output_tok_s"]), _f(ratios.get(c), 2),
                     _f(a["cache_hit_rate_later_turns"], pct=True),
                     _f(b["cache_hit_rate_later_turns"], pct=True),
                     _f(a["reprefill_tokens"]), _f(b["reprefill_tokens"]),
                     _f(a["tok_s_per_user"]), _f(b["tok_s_per_user"])])
    return [*out, "", "NVFP4 against FP8 at each concurrency both ran:", "", *_table(_VS_HEAD, rows)]


def _findings(lines: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]) -> list[str]:
    out = [_limit_line(label, cache_limits(pts), pts[-1]["concurrency"]) for label, (_, pts) in lines.items()]
    if "fp8_e4m3" in lines and "nvfp4" in lines:
        out += _versus({p["concurrency"]: p for p in lines["fp8_e4m3"][1]},
                       {p["concurrency"]: p for p in lines["nvfp4"][1]})
    return out


_METHOD = (
    "A point replays the first M x C sessions of the trace with C in flight (a session's next turn goes "
    "after its previous answer plus think time; turn t+1's prompt is turn t's prompt + its output ids + the "
    "new tokens). Caches are flushed before each point; every decode worker's pool integrity is checked "
    "after it. *cache hit* = cached / prompt tokens (usage); *re-prefilled* = tokens of turn t-1's context "
    "(whole pages of computed K/V) that turn t had to compute again; *evicted* = pages dropped from the "
    "radix caches during the point (decode counters); tok/s per user = 1 / median TPOT.")


def _setup(doc: dict[str, Any], lines: dict[str, tuple[dict[str, Any], list[dict[str, Any]]]]) -> list[str]:
    first = next(iter(lines.values()))[0]
    dep, stats = first["deployment"], doc["trace"]["stats"]
    note = f" ({dep['num_layers_note']})" if dep.get("num_layers_note") else ""
    fin, tool = stats["final_context_tokens"], stats["tool_result_tokens"]
    model = (f"- Model: `{dep['model']}` ({dep.get('model_path') or '?'}), {dep['num_layers']} layers{note}, "
             f"{dep['num_kv_heads']} KV heads x {dep['head_dim']}, page {dep['page_size']}; "
             f"GPU: {first['gpu']}; decode workers: {dep['num_decode_workers']}, prefill workers: "
             f"{dep['num_prefill_workers']}.")
    trace = (f"- Trace `{doc['trace']['path']}`: {stats['num_sessions']} sessions, {stats['num_turns']} "
             f"turns ({_f(stats['turns_per_session']['mean'])} per session), shared prefix "
             f"{stats['shared_prefix_tokens']} tokens, final context mean {_f(fin['mean'], 0)} / max "
             f"{_f(fin['max'])} tokens, tool results median {_f(tool['median'], 0)} / max {_f(tool['max'])} "
             f"tokens, answers median {_f(stats['output_tokens']['median'], 0)} tokens.")
    pools = "; ".join(f"{label}: {_f(r['deployment']['pool_pages_total'] * r['deployment']['page_size'])} "
                      "tokens over the decode workers" for label, (r, _) in lines.items())
    gen = doc["trace"].get("header", {}).get("generator") or {}
    params = ", ".join(f"{k}={v}" for k, v in gen.items())
    out = ["## Setup", "", model, trace]
    if params:
        out.append(f"- Trace generator (`benchmarks.agentic.generate`): `{params}`.")
    return [*out, f"- Pools: {pools}.", f"- Command: `{doc['command']}`", "", _METHOD]


def markdown(docs: Sequence[dict[str, Any]], sources: Sequence[str], figures: Sequence[str] | None) -> str:
    """The report; ``figures``: PNG paths relative to the report (None: matplotlib was missing)."""
    lines = series(docs)
    if not lines:
        raise ValueError("the results hold no point")
    runs = [r for r, _ in lines.values()]
    dep = runs[0]["deployment"]
    md = ["# Agentic multi-turn benchmark", ""]
    if any(r["gpu"] == "cpu" for r in runs):
        md += [(f"> **CPU smoke run** (model `{dep['model']}`, {dep['num_layers']} layers, on the CPU) "
                "with a scaled-down trace and small pools: it shows the mechanism (sessions, prefix reuse, "
                "eviction, re-prefill, integrity), not performance. The H200 sweep replaces this file."), ""]
    files = ", ".join(f"`{s}`" for s in sources)
    md += [f"Generated by `benchmarks.agentic.report` from {files}.", "", *_setup(docs[0], lines), "",
           "## Where the cache gives way", ""]
    md += _findings(lines)
    for label, (run, pts) in lines.items():
        md += ["", f"## {label}", "", *_table(_RUN_HEAD, _run_rows(pts))]
    md += _host_tier_section(lines)
    md += ["", "## Figures", ""]
    if figures is None:
        md.append('Figures need matplotlib: `pip install -e ".[bench]"`, then re-run the report.')
    else:
        md += [f"![{Path(f).stem}]({f})" for f in figures]
    return "\n".join(md) + "\n"


def plot(docs: Sequence[dict[str, Any]], out_dir: str | Path, prefix: str = "agentic_") -> list[Path]:
    """The four PNGs (see the module docstring) into ``out_dir``; RuntimeError without matplotlib."""
    from benchmarks.serving.plot import _finish, _matplotlib, _save

    plt = _matplotlib()
    from matplotlib.ticker import NullFormatter, ScalarFormatter

    lines = series(docs)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    run0 = next(iter(lines.values()))[0]
    title = f"{run0['deployment']['model']}, {run0['deployment']['num_layers']} layers, {run0['gpu']}"
    written = []

    concurrencies = sorted({p["concurrency"] for _, pts in lines.values() for p in pts})

    def finish(ax: Any, ylabel: str) -> None:
        _finish(ax, "concurrent sessions", ylabel, title, log_x=True)
        ax.set_xticks(concurrencies)
        ax.xaxis.set_major_formatter(ScalarFormatter())
        ax.xaxis.set_minor_formatter(NullFormatter())

    def simple(name: str, key: str, ylabel: str) -> None:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for label, (_, pts) in lines.items():
            xy = [(p["concurrency"], p[key]) for p in pts if p[key] is not None]
            if xy:
                ax.plot(*zip(*xy, strict=True), marker="o", label=label)
        finish(ax, ylabel)
        written.append(_save(fig, out / f"{prefix}{name}.png"))

    simple(FIGURES[0], "output_tok_s", "output tokens/s")
    simple(FIGURES[1], "tok_s_per_user", "tokens/s per user (1 / median TPOT)")

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, (_, pts) in lines.items():
        c = [p["concurrency"] for p in pts]
        line = ax.plot(c, [p["cache_hit_rate_later_turns"] or 0.0 for p in pts], marker="o",
                       label=f"{label} turns t>0")[0]
        ax.plot(c, [p["cache_hit_rate"] or 0.0 for p in pts], marker="x", linestyle="--",
                color=line.get_color(), label=f"{label} all turns")
    ax.set_ylim(0, 1.02)
    finish(ax, "input-token cache hit rate")
    written.append(_save(fig, out / f"{prefix}{FIGURES[2]}.png"))

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, (_, pts) in lines.items():
        c = [p["concurrency"] for p in pts]
        axes[0].plot(c, [p["evicted_tokens"] for p in pts], marker="o", label=label)
        axes[1].plot(c, [p["reprefill_tokens"] for p in pts], marker="o", label=label)
    finish(axes[0], "tokens evicted from the radix caches")
    finish(axes[1], "re-prefilled tokens")
    written.append(_save(fig, out / f"{prefix}{FIGURES[3]}.png"))
    return written


def write_report(docs: Sequence[dict[str, Any]], out: str | Path, sources: Sequence[str],
                 figures_dir: str | Path | None = None) -> list[Path]:
    """Write the markdown (and the PNGs, beside it unless ``figures_dir``); returns the written paths."""
    out = Path(out)
    fig_dir = Path(figures_dir) if figures_dir is not None else out.parent
    try:
        pngs = plot(docs, fig_dir, prefix=f"{out.stem}_")  # agentic.md: agentic_*.png
    except RuntimeError as exc:  # no matplotlib
        print(f"agentic-report: {exc}; writing the tables only", file=sys.stderr)
        pngs = []
        rel = None
    else:
        rel = [_relative(p, out.parent) for p in pngs]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(markdown(docs, sources, rel))
    return [out, *pngs]


def _relative(path: Path, start: Path) -> str:
    import os

    return os.path.relpath(path.resolve(), start.resolve()).replace(os.sep, "/")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="nvfp4-serve bench agentic-report", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("results", nargs="+", help="results files of `nvfp4-serve bench --trace`")
    p.add_argument("--out", default="docs/benchmarks/agentic.md", help="markdown report to write (PNGs beside it)")
    p.add_argument("--figures-dir", default=None, help="PNG directory (default: beside --out)")
    a = p.parse_args(argv)
    try:
        docs = [read_results(r) for r in a.results]
        for path in write_report(docs, a.out, a.results, a.figures_dir):
            print(path)
    except (ValueError, OSError, KeyError) as exc:
        print(f"agentic-report: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
