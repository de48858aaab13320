"""The transfer benchmark's summary (nvfp4/fp8 transfer-share ratio per path and length), table, JSON and
markdown."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from decode_svc.transfer_phases import PHASES

GOAL_RATIO = 0.6  # nvfp4's transfer share of TTFT at most 0.6x fp8's, on either path

_COLUMNS = [("kv_dtype", "kv dtype", "{}"), ("prompt_len", "prompt", "{:,}"), ("path", "path", "{}"),
            ("ttft_s", "TTFT s", "{:.3f}"), ("prefill_compute_s", "prefill compute s", "{:.3f}"),
            ("transfer_s", "transfer s", "{:.4f}"), ("transfer_share", "transfer share", "{:.1%}"),
            ("transfer_mb", "MB", "{:,.1f}"), ("ready_transfer_s", "ready: transfer s", "{:.4f}"),
            ("ready_transfer_gbps", "ready GB/s", "{:.2f}"), ("anchor_gbps", "anchor GB/s", "{:.2f}"),
            ("of_anchor", "of anchor", "{:.0%}"), ("ready_copy_gbps", "ready copy GB/s", "{:.1f}"),
            ("colocated_ttft_s", "colocated TTFT s", "{:.3f}"),
            ("prefill_of_colocated", "prefill vs colocated", "{:.0%}"), ("decode_tok_s", "decode tok/s", "{:.1f}")]


def summarize(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (path, prompt length): nvfp4 and fp8 transfer shares, their ratio and whether it meets the goal."""
    by = {(r["path"], r["prompt_len"], r["kv_dtype"]): r for r in rows}
    out = []
    for path, n in sorted({(r["path"], r["prompt_len"]) for r in rows}):
        a, b = by.get((path, n, "nvfp4")), by.get((path, n, "fp8_e4m3"))
        if a is None or b is None:
            continue
        ratio = a["transfer_share"] / b["transfer_share"] if b["transfer_share"] > 0 else None
        out.append({"path": path, "prompt_len": n, "nvfp4_share": a["transfer_share"],
                    "fp8_share": b["transfer_share"], "share_ratio": ratio,
                    "bytes_ratio": a["transfer_bytes"] / b["transfer_bytes"] if b["transfer_bytes"] else None,
                    "goal_met": ratio is not None and ratio <= GOAL_RATIO})
    return out


def _cell(fmt: str, v: Any) -> str:
    return "-" if v is None else fmt.format(v)


def table(rows: list[dict[str, Any]]) -> str:
    """The per-run markdown table."""
    lines = ["| " + " | ".join(h for _, h, _ in _COLUMNS) + " |", "|" + "---|" * len(_COLUMNS)]
    for r in rows:
        lines.append("| " + " | ".join(_cell(f, r.get(k)) for k, _, f in _COLUMNS) + " |")
    return "\n".join(lines)


def ratio_table(summary: list[dict[str, Any]]) -> str:
    lines = ["| path | prompt | nvfp4 share | fp8 share | ratio (goal <= 0.6) | bytes ratio | met |",
             "|---|---|---|---|---|---|---|"]
    for s in summary:
        lines.append(f"| {s['path']} | {s['prompt_len']:,} | {s['nvfp4_share']:.1%} | {s['fp8_share']:.1%} | "
                     f"{_cell('{:.3f}', s['share_ratio'])} | {_cell('{:.4f}', s['bytes_ratio'])} | "
                     f"{'yes' if s['goal_met'] else 'NO'} |")
    return "\n".join(lines)


def phase_table(rows: list[dict[str, Any]]) -> str:
    """The ready transfers on the decode's clock, phase by phase (decode_svc/transfer_phases.py); stream GB/s is
    the bytes over the stream phase alone: the rate of the page messages once the first one came. Beside them,
    from the prefill's sender process where it sent the bytes: its exports' time (summed over its threads) and
    its stream's waits for them ("-" where the engine's process sent them)."""
    names = list(PHASES)
    lines = ["| kv dtype | prompt | path | ready transfer ms | " + " | ".join(f"{n.replace('_', ' ')} ms" for n in names)
             + " | stream GB/s | sender: exports ms | sender: waiting for exports ms |", "|" + "---|" * (7 + len(names))]
    for r in rows:
        ph = r.get("ready_phases_s")
        if not ph:
            continue
        stream = ph.get("stream", 0.0)
        gbps = r["ready_transfer_bytes"] / stream / 1e9 if stream > 0 and r.get("ready_transfer_bytes") else None
        lines.append(f"| {r['kv_dtype']} | {r['prompt_len']:,} | {r['path']} | {r['ready_transfer_s'] * 1e3:.1f} | "
                     + " | ".join(f"{ph.get(n, 0.0) * 1e3:.1f}" for n in names) + f" | {_cell('{:.2f}', gbps)} | "
                     + " | ".join(_cell("{:.1f}", None if r.get(k) is None else r[k] * 1e3)
                                  for k in ("ready_sender_export_s", "ready_sender_export_wait_s")) + " |")
    return "\n".join(lines)


def anchor_table(anchors: dict[str, Any]) -> str:
    lines = ["| anchor | setting | GB/s |", "|---|---|---|"]
    for r in anchors.get("raw_grpc", []):
        heap = ", services' heap setting" if r.get("keep_freed_blocks") else ""
        if r.get("http2_max_frame_bytes"):
            heap += f", HTTP/2 frames up to {r['http2_max_frame_bytes']:,} B"
        lines.append(f"| raw grpcio, 2 processes | {r['channels']} channel(s), {r['message_bytes']:,} B messages{heap} | "
                     f"{r['best_gb_s']:.2f} |")
    g = anchors.get("device_gather")
    if g:
        lines.append(f"| device gather ({g['device']}) | {g['num_pages']:,} pages of {g['page_bytes']:,} B, random "
                     f"order | {g['gb_s']:.1f} |")
    return "\n".join(lines)


_SENDERS = {"auto": "their sender process on a GPU (`--kv-sender auto`)", "process": "their sender process",
            "thread": "their engine process (`--kv-sender thread`)"}


def markdown(doc: dict[str, Any]) -> str:
    s = doc["setup"]
    met = [x["goal_met"] for x in doc["summary"]]
    verdict = ("met on every path and length" if met and all(met) else
               "NOT met where the last column says NO" if met else "not measured (needs both dtypes)")
    return "\n".join([
        "# KV transfer prefill -> decode: gRPC bytes vs CUDA IPC, each against its anchor", "",
        f"Command: `{doc['command']}`", "",
        (f"GPU: {doc['gpu']} (prefill on GPU {s['prefill_gpu']}, decode on GPU {s['decode_gpu']}). Model: "
        f"{s['model']} ({s['num_layers']} layers, {s['num_kv_heads']} KV heads x head_dim {s['head_dim']}), "
        f"page {s['page_size']}, chunked prefill {s['chunk_size']}, {s['decode_tokens']} generated tokens per "
        f"request, the prefills' grpc page bytes sent by {_SENDERS.get(s.get('kv_sender', ''), 'their engine process')}, "
        f"one request at a time on idle services, unique random prompts (no cache hits), each then "
        f"sent again (\"ready\": the prefill's cache holds its pages; the best of {s.get('ready_repeats', 1)} "
        f"transfers, as each anchor is the best of its repeats), then once through the decode's own engine "
        f"(\"colocated TTFT\": no prefill service, the colocated prompt path)."), "",
        ("TTFT is the client's (Generate sent -> first token). Prefill compute is the prefill service's own "
        "time from submit to the prompt's last layer (`nvfp4_prefill_ttft_seconds`); transfer is the decode's "
        "time from the transfer header to the last page in its pool, copies complete "
        "(`nvfp4_decode_kv_transfer_seconds`); transfer share = transfer / TTFT. Decode tok/s is one sequence "
        "at that context (batch 1). The path column is the path the decode's metrics say was taken. Pages "
        "stream while the prefill computes, so the first transfer's time includes compute after the first chunk; "
        "the ready columns are the same prompt again with every page ready at once: the path's own speed "
        "(header to last page, every write complete), against its anchor from this run (raw grpcio on one "
        "channel for grpc, on any channel count for grpc-lanes, one device gather for cuda-ipc and, on a GPU, for nixl); "
        "ready copy GB/s counts only the decode's pool "
        "writes. Prefill vs colocated = colocated TTFT / prefill compute: the prefill service's prompt tokens per "
        "second while it streams, against the colocated engine's on the same prompt"
        + (f"; the median over {s['compute_repeats']} unique prompts, each cold on both."
           if s.get("compute_repeats", 1) > 1 else ".")), "",
        table(doc["rows"]), "", "## Anchors (same run)", "", anchor_table(doc.get("anchors", {})), "",
        "## The ready transfers, phase by phase (the decode's clock)", "",
        ("From the transfer header: first page = until the first page message (the prefill's first export), "
         "stream = the page messages, done = the last page message to PrefillDone, drain = the pool writes still "
         "running after it, finish = the one check of every written page. They add up to the ready transfer. "
         "The sender columns are the prefill's sender process (its exports, summed over its threads, and its "
         "stream's waits for them): waits near the stream phase say the prefill's exports, not the transport or "
         "the decode, set its pace."), "",
        phase_table(doc["rows"]), "",
        f"## nvfp4 / fp8 transfer share (goal: <= {GOAL_RATIO}x on either path)", "",
        ratio_table(doc["summary"]), "", f"Goal: {verdict}.", ""])


def write(doc: dict[str, Any], json_path: Path, md_path: Path) -> None:
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(doc, indent=2) + "\n")
    md_path.parent.mkdir(parents=True, exist_ok=True)
    md_path.write_text(markdown(doc))
