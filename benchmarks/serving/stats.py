"""The figures of one benchmark point, from the client-side request timings.

Definitions (times are client arrival times of SSE chunks, see ``client``):

- duration: from the point's start (before the first request is sent) to the end of the last stream.
- request / input / output throughput: successful requests, their prompt tokens and completion tokens
  (usage counts) divided by the duration.
- TTFT: first chunk - request sent. ITL: the gaps between consecutive chunks of a request, pooled over all
  requests. TPOT: (end - first chunk) / (completion tokens - 1) per request. tokens/s per user: 1 / the
  median TPOT (the median request's decode speed; a mean of 1 / TPOT would be ruled by bursty outliers).
- peak-batch decode throughput: a request is *decoding* from its first chunk to its end. The *full-batch
  time* is when at least B = min(concurrency, num_prompts) requests are decoding. Each chunk after a
  request's first one carries w tokens: the number of ids it carried when the server returned them
  (``return_token_ids``), else w = completion_tokens / num_chunks of that request (exact when every chunk is
  one token). ``peak_decode_tok_s`` is the max over windows [s, s + W) (W = ``peak_window_s``,
  1 s by default) lying wholly inside the full-batch time of (sum of w of the chunks in the window) / W;
  None when no full-batch stretch lasts W. ``full_batch_decode_tok_s`` is the same weighted count over all
  of the full-batch time divided by its length (the mean rate at full batch).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np

from benchmarks.serving.client import RequestResult


def distribution(values: Sequence[float], scale: float = 1.0) -> dict[str, float | None]:
    """mean / median / p90 / p99 / min / max of ``values`` times ``scale`` (None each when empty)."""
    if not values:
        return {k: None for k in ("mean", "median", "p90", "p99", "min", "max")}
    a = np.asarray(values, dtype=np.float64) * scale
    return {"mean": float(a.mean()), "median": float(np.median(a)), "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)), "min": float(a.min()), "max": float(a.max())}


def full_batch_intervals(results: Sequence[RequestResult], batch: int) -> list[tuple[float, float]]:
    """Maximal stretches [a, b] (b > a) during which at least ``batch`` requests are decoding.

    At equal times ends are applied before starts (a hand-over does not count as full)."""
    events = []
    for r in results:
        if r.ok and r.chunk_times:
            events.append((r.chunk_times[0], 1))
            events.append((r.end, -1))
    events.sort(key=lambda e: (e[0], e[1]))
    out, count, since = [], 0, 0.0
    for t, delta in events:
        was_full = count >= batch
        count += delta
        if not was_full and count >= batch:
            since = t
        elif was_full and count < batch and t > since:
            out.append((since, t))
    return out


def decode_chunks(results: Sequence[RequestResult]) -> tuple[list[float], list[float]]:
    """(times, weights) of every chunk after a request's first, sorted by time (see the module docstring)."""
    pairs = []
    for r in results:
        if r.ok and len(r.chunk_times) > 1:
            if len(r.chunk_tokens) == len(r.chunk_times):
                pairs += list(zip(r.chunk_times[1:], r.chunk_tokens[1:], strict=True))
            else:
                w = r.completion_tokens / len(r.chunk_times)
                pairs += [(t, w) for t in r.chunk_times[1:]]
    pairs.sort()
    return [t for t, _ in pairs], [w for _, w in pairs]


def peak_batch_decode(results: Sequence[RequestResult], batch: int, window_s: float) -> dict[str, Any]:
    """``peak_decode_tok_s``, ``full_batch_decode_tok_s``, ``full_batch_s`` (total full-batch time),
    ``batch`` and ``window_s``; see the module docstring."""
    intervals = full_batch_intervals(results, batch)
    times, weights = decode_chunks(results)
    prefix = np.concatenate([[0.0], np.cumsum(weights)]) if weights else np.zeros(1)

    def tokens_in(lo: float, hi: float, closed: bool) -> float:
        j = bisect.bisect_right(times, hi) if closed else bisect.bisect_left(times, hi)
        return float(prefix[j] - prefix[bisect.bisect_left(times, lo)])

    peak, full_tokens, full_s = None, 0.0, 0.0
    for a, b in intervals:
        full_s += b - a
        full_tokens += tokens_in(a, b, closed=True)
        if b - a < window_s:
            continue
        # The windowed sum only changes when a chunk enters or leaves, so the max is reached with the window
        # starting at a chunk time or pushed against the stretch's end.
        lo, hi = bisect.bisect_left(times, a), bisect.bisect_right(times, b - window_s)
        for s in [*times[lo:hi], b - window_s]:
            rate = tokens_in(s, s + window_s, closed=False) / window_s
            peak = rate if peak is None else max(peak, rate)
    mean = full_tokens / full_s if full_s > 0 else None
    return {"peak_decode_tok_s": peak, "full_batch_decode_tok_s": mean, "full_batch_s": full_s,
            "batch": batch, "window_s": window_s}


def summarize(results: Sequence[RequestResult], duration_s: float, batch: int, window_s: float,
              num_gpus: int = 1) -> dict[str, Any]:
    """Every client-side figure of one point (JSON-able); failed requests count only in ``failed``."""
    ok = [r for r in results if r.ok]
    input_tokens = sum(r.prompt_tokens for r in ok)
    output_tokens = sum(r.completion_tokens for r in ok)
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itl]
    tpots = [t for r in ok if (t := r.tpot) is not None and t > 0]
    per_s = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: 0.0)
    out: dict[str, Any] = {
        "completed": len(ok), "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:10],
        "duration_s": duration_s, "total_input_tokens": input_tokens, "total_output_tokens": output_tokens,
        "cached_tokens": sum(r.cached_tokens for r in ok),
        "request_throughput": per_s(len(ok)), "input_tok_s": per_s(input_tokens),
        "output_tok_s": per_s(output_tokens), "total_tok_s": per_s(input_tokens + output_tokens),
        "output_tok_s_per_gpu": per_s(output_tokens) / num_gpus,
        "ttft_ms": distribution(ttfts, 1e3), "itl_ms": distribution(itls, 1e3),
        "tpot_ms": distribution(tpots, 1e3),
        "e2e_ms": distribution([r.end - r.start for r in ok], 1e3),
        "tok_s_per_user": 1.0 / float(np.median(tpots)) if tpots else None,
    }
    out.update(peak_batch_decode(ok, batch, window_s))
    return out
