"""Host work before a decode graph replay, while the GPU waits: staging the fixed buffers (page table included)
and, for fp8/bf16, FlashInfer's paged CSR. Each row times the path the engine takes against the one it replaced,
in the same run, on this machine's CPU (no GPU needed; on a GPU host the staging copies are H2D instead of
memcpy, so the staging figure there is a little higher):

    python -m benchmarks.engine.bench_host_staging [--shapes 1x32768 16x32768 44x32768] \\
        --out docs/benchmarks/host_staging.json --md docs/benchmarks/host_staging.md

- staging: ``DecodeGraphRunner`` staging of B requests of L tokens (page 16), with the page table refilled every
  step (``append_only=False``) or only each row's new pages written (``append_only=True``, what
  ``ModelRunner`` asks for), the rows from ``PageTableRows`` as in serving, a page appended to every row every
  16 steps; per step, median of ``--rounds`` rounds of ``--steps`` steps.
- CSR: ``paged_indices_host`` pieces for the same padded table: the whole-table mask and the row cut.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

from benchmarks.engine.doc_files import write_doc

PAGE = 16


def _runner(max_batch: int, max_width: int):
    from engine.config import CacheConfig, EngineConfig
    from engine.decode_graphs import DecodeGraphRunner
    from engine.engine import Engine
    from offline.tiny_model import make_tiny_model

    model = make_tiny_model(tempfile.mkdtemp())
    eng = Engine(EngineConfig(model_dir=str(model), device="cpu", dtype="float32",
                              cache=CacheConfig(page_size=PAGE, max_total_tokens=4096)))
    return DecodeGraphRunner(eng.model, eng.paths, eng.device, max_batch, max_width, capture=False)


def _per_step_ms(fn, steps: int, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for k in range(steps):
            fn(k)
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times)


def _stepper(runner, entry, reqs: list, rows, tokens: int, append_only: bool):
    """One decode step's staging of ``reqs``; every 16th step first appends a page to every request."""
    zeros = [0] * len(reqs)

    def step(k: int) -> None:
        if k % PAGE == 0:
            for r in reqs:
                r.page_ids.append(r.page_ids[-1] + 1)
        runner._stage(entry, zeros, zeros, rows.rows(reqs), [tokens] * len(reqs), zeros, append_only=append_only)

    return step


def measure(batch: int, tokens: int, steps: int, rounds: int) -> dict:
    from engine.decode_graphs import width_bucket
    from engine.model_runner import PageTableRows
    from engine.request import Request
    from engine.sampling import SamplingParams
    from nvfp4_kernels.backends.flashinfer_backend import csr_masked, csr_rows

    pages = -(-(tokens + 1) // PAGE)
    width = width_bucket(pages + steps * rounds * 2 // PAGE + 1, 1 << 20)
    runner = _runner(max(batch, 1), width)
    bb = next(x for x in runner.buckets if x >= batch)
    entry = runner._build(bb, width)
    greedy = SamplingParams(temperature=0.0, max_tokens=1)
    out = {"batch": batch, "tokens": tokens, "table": [bb, width]}
    for append_only in (False, True):
        reqs = [Request(f"r{i}", [1], greedy, page_ids=list(range(i * pages, (i + 1) * pages)))
                for i in range(batch)]
        step = _stepper(runner, entry, reqs, PageTableRows(), tokens, append_only)
        step(0)
        out["staging_append_only_ms" if append_only else "staging_refill_ms"] = _per_step_ms(step, steps, rounds)
    table = runner._host_table(bb, width)
    num_pages = np.full(bb, pages, dtype=np.int64)
    for name, fn in (("csr_mask_ms", csr_masked), ("csr_rows_ms", csr_rows)):
        out[name] = _per_step_ms(lambda k, f=fn: f(table, num_pages), steps, rounds)
    return out


def render(doc: dict) -> str:
    lines = ["# Host work before a decode graph replay (CPU)", "",
             (f"Command: `{doc['command']}`. CPU: {doc['cpu']}. Milliseconds of host work per decode step, median "
              "of rounds; the GPU waits for this work before each replay."), "",
             ("| B x L | table | staging, refilled | staging, new pages only | saved | CSR, mask | CSR, rows | "
              "saved |"), "|---|---|---|---|---|---|---|---|"]
    for r in doc["rows"]:
        lines.append(f"| {r['batch']} x {r['tokens']} | {r['table'][0]} x {r['table'][1]} | "
                     f"{r['staging_refill_ms']:.3f} | {r['staging_append_only_ms']:.3f} | "
                     f"{r['staging_refill_ms'] - r['staging_append_only_ms']:.3f} | {r['csr_mask_ms']:.3f} | "
                     f"{r['csr_rows_ms']:.3f} | {r['csr_mask_ms'] - r['csr_rows_ms']:.3f} |")
    lines += ["", ("Staging, new pages only: what the engine runs. CSR (fp8/bf16 only): the engine cuts rows from "
                   "tables of 512 pages and wider and masks narrower ones.")]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shapes", nargs="+", default=["1x32768", "16x32768", "44x32768"])
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default="docs/benchmarks/host_staging.json")
    p.add_argument("--md", default="docs/benchmarks/host_staging.md")
    a = p.parse_args(argv)
    if a.steps < 1 or a.rounds < 1:
        p.error("--steps and --rounds must be >= 1")
    shapes = []
    for s in a.shapes:
        try:
            b, n = (int(x) for x in s.split("x"))
        except ValueError:
            p.error(f"--shapes takes BxL pairs like 44x32768, got {s!r}")
        if b < 1 or n < 1:
            p.error(f"--shapes needs B, L >= 1, got {s!r}")
        shapes.append((b, n))
    torch.set_num_threads(1)
    doc = {"command": "python -m benchmarks.engine.bench_host_staging " + " ".join(argv if argv is not None
                                                                                    else sys.argv[1:]),
           "cpu": platform.processor() or platform.machine(),
           "rows": [measure(b, n, a.steps, a.rounds) for b, n in shapes]}
    write_doc(doc, a.out, a.md, render)
    return 0


if __name__ == "__main__":
    sys.exit(main())
