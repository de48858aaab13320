"""The NVFP4 decode's DRAM traffic against the bytes its pages hold, from Nsight Compute's CSV.

Pipeline stage ``tma_ncu_bytes`` profiles the decode kernel (``probe_tma --launch-only BxL [--launch-config C]``,
one launch per shape and config) with ``dram__bytes_read.sum``, the L2 sectors the TMA reads
(``lts__t_sectors_srcunit_tex_op_read.sum``), the L2 hit rate and the kernel's time. This reads that CSV (several
files may be given) and prints, per config and shape: the time, DRAM bytes read over the pages' bytes
(``bench_decode.nvfp4_bytes``: codes and block scales of K and V), L2 sectors requested over the pages' sectors, the
hit rate and the DRAM throughput. A ratio above 1 is data fetched from DRAM more than once.

    python -m benchmarks.kernels.ncu_bytes docs/benchmarks/ncu/decode_bytes_h100.csv \\
        --gpu "H100 80GB HBM3" --out-json docs/benchmarks/decode_dram_bytes_h100.json \\
        --out-md docs/benchmarks/decode_dram_bytes_h100.md
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import re
import sys
from dataclasses import asdict, dataclass

from benchmarks.kernels.bench_decode import nvfp4_bytes

_LAUNCHED = re.compile(r"launched (\S+) at (\d+)x(\d+): (\d+) splits")


@dataclass(frozen=True)
class KernelBytes:
    config: str
    shape: str
    splits: int
    kernel_us: float
    dram_read_gb: float
    pages_gb: float
    dram_over_pages: float
    l2_sectors_over_pages: float
    l2_hit_pct: float
    dram_pct_of_peak: float


def _num(text: str) -> float:
    return float(text.replace(",", ""))


def _row(launch: re.Match, metrics: dict[str, str]) -> KernelBytes:
    label, b, n, splits = launch.group(1), int(launch.group(2)), int(launch.group(3)), int(launch.group(4))
    if "dram__bytes_read.sum" not in metrics:
        raise ValueError(f"no decode-kernel metrics for {launch.group(0)!r}")
    pages = nvfp4_bytes(b, n)
    read = _num(metrics["dram__bytes_read.sum"])
    return KernelBytes(label, f"{b}x{n}", splits, _num(metrics["gpu__time_duration.sum"]) / 1e3, read / 1e9,
                       pages / 1e9, read / pages,
                       _num(metrics["lts__t_sectors_srcunit_tex_op_read.sum"]) * 32 / pages,
                       _num(metrics["lts__t_sector_op_read_hit_rate.pct"]),
                       _num(metrics["dram__throughput.avg.pct_of_peak_sustained_elapsed"]))


def parse(text: str) -> list[KernelBytes]:
    """Each profiled launch of the decode kernel in an ncu CSV of one or more runs, in file order: a run's
    "launched" line (the probe's) comes first, its metrics (ncu's, printed as the process ends) after it."""
    out, launch, metrics, header = [], None, {}, None
    for line in text.splitlines():
        m = _LAUNCHED.match(line)
        if m:
            if launch is not None:
                out.append(_row(launch, metrics))
            launch, metrics = m, {}
        elif line.startswith('"'):
            row = next(csv.reader(io.StringIO(line)))
            if row[0] == "ID":
                header = row
            elif header is not None and "nvfp4_decode" in row[header.index("Kernel Name")]:
                metrics[row[header.index("Metric Name")]] = row[header.index("Metric Value")]
    if launch is not None:
        out.append(_row(launch, metrics))
    return out


def table(rows: list[KernelBytes]) -> str:
    head = ("| config | shape | splits | kernel us | DRAM read GB | pages GB | DRAM / pages | L2 sectors / pages "
            "| L2 hit % | DRAM % of peak |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.config} | {r.shape} | {r.splits} | {r.kernel_us:.0f} | {r.dram_read_gb:.3f} | "
                     f"{r.pages_gb:.3f} | {r.dram_over_pages:.3f} | {r.l2_sectors_over_pages:.3f} | "
                     f"{r.l2_hit_pct:.1f} | {r.dram_pct_of_peak:.1f} |")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv", nargs="+", help="ncu CSV output of stage tma_ncu_bytes")
    ap.add_argument("--gpu", required=True, help="the GPU the CSV was measured on (printed in the report)")
    ap.add_argument("--out-json", default=None)
    ap.add_argument("--out-md", default=None)
    a = ap.parse_args(argv)
    rows = []
    for path in a.csv:
        with open(path) as f:
            rows += parse(f.read())
    if not rows:
        ap.error("no profiled decode launch in " + ", ".join(a.csv))
    text = table(rows)
    print(text)
    if a.out_json:
        with open(a.out_json, "w") as f:
            json.dump({"gpu": a.gpu, "sources": a.csv, "rows": [asdict(r) for r in rows]}, f, indent=1)
    if a.out_md:
        with open(a.out_md, "w") as f:
            f.write(f"# NVFP4 decode: DRAM bytes read against the pages' bytes ({a.gpu})\n\n"
                    f"`python -m benchmarks.kernels.ncu_bytes {' '.join(a.csv)} --gpu \"{a.gpu}\"` on the CSV of "
                    "pipeline stage `tma_ncu_bytes` (Nsight Compute, clocks left alone, one launch per row).\n\n"
                    + text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
