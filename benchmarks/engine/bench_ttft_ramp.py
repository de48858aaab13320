"""Where the time of a prefill ramp goes, per KV dtype: N prompts submitted at once to a bare Engine (no services).

    python -m benchmarks.engine.bench_ttft_ramp --model DIR [--num-layers 8] [--num-prompts 40]
        [--input-len 32768] [--chunk-size 8192] [--kv-dtypes fp8_e4m3 nvfp4] [--out JSON]

Every scheduler step is one extend chunk plus one decode step of the requests already running; this times
each phase with a device synchronisation around it (``ModelRunner.extend`` / ``ModelRunner.launch_decode``) until
every request has its first token, and reports the TTFT distribution (from submission), the extend and
decode seconds of the ramp, and the extend throughput. One subprocess per dtype (a fresh GPU each time).
It separates the engine's share of an end-to-end TTFT difference from the serving stack's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def _one(a: argparse.Namespace, kv_dtype: str) -> dict:
    import torch

    from engine.config import CacheConfig, EngineConfig, SchedulerConfig
    from engine.engine import Engine
    from engine.sampling import SamplingParams

    eng = Engine(EngineConfig(
        model_dir=a.model, num_layers=a.num_layers,
        cache=CacheConfig(kv_dtype=kv_dtype, mem_fraction_static=a.mem_fraction_static,
                          workspace_tokens=a.workspace_tokens),
        # each part is timed on its own (synchronised), so decode steps are read before the next is launched
        scheduler=SchedulerConfig(chunk_size=a.chunk_size, disable_overlap_schedule=True)))
    runner = eng.runner
    sync = torch.cuda.synchronize if eng.device.type == "cuda" else (lambda: None)
    spent = {"extend": 0.0, "decode": 0.0}
    counts = {"extend": 0, "decode": 0}

    def timed(name, fn):
        def wrapper(*args, **kw):
            sync()
            t = time.perf_counter()
            out = fn(*args, **kw)
            sync()
            spent[name] += time.perf_counter() - t
            counts[name] += 1
            return out
        return wrapper

    g = torch.Generator().manual_seed(0)
    vocab = eng.model_config.vocab_size
    sp = SamplingParams(temperature=0.0, max_tokens=a.output_len, ignore_eos=True)
    # warm-up (JIT, first graphs) on a short prompt, not measured
    eng.generate([torch.randint(10, vocab - 10, (512,), generator=g).tolist()],
                 SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    # a decode step is its launch (timed to its completion) and the read of its tokens
    runner.extend, runner.launch_decode = timed("extend", runner.extend), timed("decode", runner.launch_decode)
    reqs = [eng.new_request(torch.randint(10, vocab - 10, (a.input_len,), generator=g).tolist(), sp)
            for _ in range(a.num_prompts)]
    t0 = time.perf_counter()
    for r in reqs:
        eng.scheduler.submit(r)
    first: dict[str, float] = {}
    steps = 0
    while len(first) < len(reqs):
        for out in eng.scheduler.step():
            if out.new_token_ids and out.rid not in first:
                first[out.rid] = time.perf_counter() - t0
        steps += 1
    wall = time.perf_counter() - t0
    ttft = sorted(first.values())
    return {"kv_dtype": kv_dtype, "num_prompts": a.num_prompts, "input_len": a.input_len, "steps": steps,
            "ramp_s": wall, "extend_s": spent["extend"], "extend_calls": counts["extend"],
            "decode_s": spent["decode"], "decode_calls": counts["decode"],
            "host_s": wall - spent["extend"] - spent["decode"],
            "extend_tok_s": a.num_prompts * a.input_len / spent["extend"],
            "ttft_mean_s": sum(ttft) / len(ttft), "ttft_median_s": ttft[len(ttft) // 2], "ttft_max_s": ttft[-1]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--num-layers", type=int, default=None)
    p.add_argument("--kv-dtypes", nargs="+", default=["fp8_e4m3", "nvfp4"])
    p.add_argument("--num-prompts", type=int, default=40)
    p.add_argument("--input-len", type=int, default=32768)
    p.add_argument("--output-len", type=int, default=1024)
    p.add_argument("--chunk-size", type=int, default=8192)
    p.add_argument("--mem-fraction-static", type=float, default=0.22)
    p.add_argument("--workspace-tokens", type=int, default=262144)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # internal: run one dtype, print JSON
    p.add_argument("--out", default="docs/benchmarks/engine_ttft_ramp.json")
    a = p.parse_args(argv)
    if a.one:
        print("RESULT " + json.dumps(_one(a, a.one)), flush=True)
        return 0
    rows = []
    base = [x for x in (argv if argv is not None else sys.argv[1:]) if x]
    for dt in a.kv_dtypes:
        proc = subprocess.run([sys.executable, "-m", "benchmarks.engine.bench_ttft_ramp", *base, "--one", dt],
                              check=False, capture_output=True, text=True)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
        row = json.loads(line[-1][7:]) if line else {"kv_dtype": dt, "error": proc.stderr[-2000:]}
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"command": " ".join(["python -m benchmarks.engine.bench_ttft_ramp", *base]), "rows": rows}
    with open(a.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"{'kv':>9} {'ramp s':>7} {'extend s':>9} {'decode s':>9} {'host s':>7} {'extend tok/s':>13} "
          f"{'TTFT mean':>10}")
    for r in rows:
        if "error" in r:
            print(f"{r['kv_dtype']:>9} error: {r['error'][-300:]}")
            continue
        print(f"{r['kv_dtype']:>9} {r['ramp_s']:7.2f} {r['extend_s']:9.2f} {r['decode_s']:9.2f} {r['host_s']:7.2f} "
              f"{r['extend_tok_s']:13.0f} {r['ttft_mean_s']:10.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
