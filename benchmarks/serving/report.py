"""Tables on stdout and the results JSON."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any


def fmt_number(value: Any, digits: int = 2) -> str:
    """A table cell: "-" for None, thousands separators, ``digits`` decimals for floats."""
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.{digits}f}" if math.isfinite(value) else str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _three(d: dict[str, Any]) -> str:
    return f"{fmt_number(d['mean'])} / {fmt_number(d['median'])} / {fmt_number(d['p99'])}"


def point_table(doc: dict[str, Any], point: dict[str, Any]) -> str:
    """A ``sglang.bench_serving``-like block for one point."""
    dep, pool = doc["deployment"], point["server"]["pool"]
    hits = point["server"]["decode_metrics"].get("sum", {}).get("prefix_cache_hit_tokens_total")
    hits = round(hits) if hits is not None else None
    ttft, itl, tpot = point["ttft_ms"], point["itl_ms"], point["tpot_ms"]
    layers = f"{dep['num_layers']}" + (f" ({dep['num_layers_note']})" if dep["num_layers_note"] else "")
    rows = [
        ("Model", dep["model"]), ("KV cache dtype", dep["kv_dtype"]), ("Layers", layers), ("GPU", doc["gpu"]),
        ("Input / output length", f"{point['input_len']} / {point['output_len']}"),
        ("Concurrency", point["concurrency"]), ("Successful requests", point["completed"]),
        ("Failed requests", point["failed"]), ("Duration (s)", point["duration_s"]),
        ("Total input tokens", point["total_input_tokens"]),
        ("Total output tokens", point["total_output_tokens"]),
        ("Request throughput (req/s)", point["request_throughput"]),
        ("Input token throughput (tok/s)", point["input_tok_s"]),
        ("Output token throughput (tok/s)", point["output_tok_s"]),
        (f"Peak-batch decode (tok/s, B={point['batch']})", point["peak_decode_tok_s"]),
        ("Full-batch mean decode (tok/s)", point["full_batch_decode_tok_s"]),
        ("Tokens/s per user", point["tok_s_per_user"]),
        ("TTFT mean / median / p99 (ms)", _three(ttft)), ("ITL mean / median / p99 (ms)", _three(itl)),
        ("TPOT mean / median / p99 (ms)", _three(tpot)),
        ("Pool pages total (decode)", pool["pages_total"]),
        ("Peak pages in use / used", f"{fmt_number(pool['peak_pages_in_use'])} / {fmt_number(pool['peak_pages_used'])}"),
        ("Peak running requests", pool["peak_running"]),
        ("Cached prompt tokens (usage)", point["cached_tokens"]),
        ("Prefix-cache hit tokens (decode)", hits),
    ]
    width = max(len(k) for k, _ in rows) + 2
    bar = "=" * (width + 24)
    lines = [bar, " nvfp4-serve serving benchmark ".center(width + 24, "="), bar]
    lines += [f"{k + ':':<{width}}{fmt_number(v):>24}" for k, v in rows]
    if point["errors"]:
        lines.append("errors: " + "; ".join(point["errors"]))
    lines.append(bar)
    return "\n".join(lines)


_SWEEP_COLS = (("C", "concurrency", 0), ("ok", "completed", 0), ("fail", "failed", 0),
               ("req/s", "request_throughput", 2), ("in tok/s", "input_tok_s", 0),
               ("out tok/s", "output_tok_s", 1),
               ("peak dec tok/s", "peak_decode_tok_s", 1), ("tok/s/user", "tok_s_per_user", 1))


def sweep_table(doc: dict[str, Any]) -> str:
    """One row per point."""
    dep = doc["deployment"]
    head = [name for name, _, _ in _SWEEP_COLS] + ["TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "peak pages"]
    rows = []
    for p in doc["points"]:
        row = [fmt_number(p[key], d) for _, key, d in _SWEEP_COLS]
        row += [fmt_number(p["ttft_ms"]["median"], 1), fmt_number(p["ttft_ms"]["p99"], 1), fmt_number(p["itl_ms"]["median"], 2),
                fmt_number(p["server"]["pool"]["peak_pages_in_use"])]
        rows.append(row)
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(head)]
    first = doc["points"][0] if rows else {}
    title = (f"{dep['model']}  kv {dep['kv_dtype']}  {dep['num_layers']} layers  GPU {doc['gpu']}  "
             f"in/out {first['input_len']}/{first['output_len']}" if rows else "no points")
    lines = [title, "  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines += ["  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def write_json(doc: dict[str, Any], path: str | Path) -> None:
    """Write atomically (a sweep rewrites the file after every point)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, separators=(",", ":"), allow_nan=False) + "\n")  # compact: per-request records
    os.replace(tmp, path)


def read_json(path: str | Path) -> dict[str, Any]:
    doc = json.loads(Path(path).read_text())
    if not isinstance(doc, dict) or "points" not in doc or "deployment" not in doc:
        raise ValueError(f"{path} is not a results file of python -m benchmarks.serving (no points)")
    return doc
