"""``nvfp4-serve bench experiments``: the KV-dtype comparison, one deployment per KV dtype.

For each ``--kv-dtypes`` D, ONE ``nvfp4-serve up LAUNCH_ARGS --kv-cache-dtype D`` is started, every point of
D runs against it, and it is stopped before the next dtype starts. Points, in this order:

    iso_concurrency  --iso L:C ...             the same C for every dtype at input length L; C "fit": the
                                               largest C that this dtype's pool AND every earlier dtype's
                                               holds (list the smallest pool first: bf16, the default order)
    iso_capacity     --capacity-input-lens L   each dtype at the largest C its pool holds (below)
    sweep            --sweep-concurrency C ... at --sweep-input-len (the Pareto curve)

Each point sends C x ``--prompts-per-concurrency`` prompts of exactly L tokens asking for ``--output-len``
tokens; the prefix caches are flushed before each point; ``--warmup`` requests run before a deployment's
first point only. A pool holds ``floor(pool tokens / (page-rounded (L + output) + one page))`` requests per
decode worker (the extra page covers the decode reserve); that is capped by ``--max-concurrency``, the
router's admission limit and the decode services' ``--max-running-requests``. A point that needs more than
the pool holds is skipped (it would measure queueing, at a cost in device time), a point that fails keeps
its error, and a dtype whose deployment does not start keeps its error: nothing is dropped silently.

The results JSON is rewritten after every point (a killed run keeps what it measured); the markdown report
and the plots (``experiments_report``) are regenerated after every deployment.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, NamedTuple

from benchmarks.serving.config import BenchConfig, Target
from benchmarks.serving.launch import LaunchedDeployment
from benchmarks.serving.launch_args import KEY_ENVS, flag_value, resolve_api_key
from benchmarks.serving.report import write_json
from benchmarks.serving.runner import Session, run_point
from benchmarks.serving.server import describe_deployment, gpu_name
from svc_common.cli_help import HelpFormatter

SCHEMA = "nvfp4-serve/bench-experiments/1"
KV_DTYPES = ("bf16", "fp8_e4m3", "nvfp4")  # nvfp4_kernels.kv_layout.KV_DTYPES (not imported: no torch here)
EXPERIMENTS = ("iso_concurrency", "iso_capacity", "sweep")
DEFAULT_MAX_RUNNING_REQUESTS = 256  # engine.config.SchedulerConfig's (tests pin the two together)
DEFAULT_OUT = "docs/benchmarks/serving.json"


class PointSpec(NamedTuple):
    experiment: str  # one of EXPERIMENTS
    input_len: int
    concurrency: int | str  # an integer, "fit" (iso_concurrency) or "max" (iso_capacity)


@dataclass(frozen=True)
class ExperimentPlan:
    """What ``experiments`` runs for every KV dtype (see the module docstring)."""

    kv_dtypes: tuple[str, ...] = KV_DTYPES
    iso: tuple[tuple[int, int | str], ...] = ()  # (input length, concurrency or "fit")
    capacity_input_lens: tuple[int, ...] = ()
    sweep_concurrency: tuple[int, ...] = ()
    sweep_input_len: int = 32768
    output_len: int = 1024
    prompts_per_concurrency: int = 1
    max_concurrency: int | None = None
    target_input_len: int = 32768  # where the design targets are read
    bench: BenchConfig = field(default_factory=lambda: BenchConfig(1, 1, 1, 1, save_requests=False))

    def __post_init__(self) -> None:
        if not self.kv_dtypes or len(set(self.kv_dtypes)) != len(self.kv_dtypes):
            raise ValueError(f"--kv-dtypes needs distinct dtypes, got {list(self.kv_dtypes)}")
        bad = [d for d in self.kv_dtypes if d not in KV_DTYPES]
        if bad:
            raise ValueError(f"--kv-dtypes: unknown {bad}; choose from {', '.join(KV_DTYPES)}")
        if not (self.iso or self.capacity_input_lens or self.sweep_concurrency):
            raise ValueError("nothing to run: give --iso L:C ..., --capacity-input-lens L ... and/or "
                             "--sweep-concurrency C ...")
        lens = [length for length, _ in self.iso] + [*self.capacity_input_lens, self.sweep_input_len]
        for name, value in [("input length", n) for n in lens] + [
                ("--output-len", self.output_len), ("--prompts-per-concurrency", self.prompts_per_concurrency),
                *(("--sweep-concurrency", c) for c in self.sweep_concurrency),
                *(("--iso concurrency", c) for _, c in self.iso if c != "fit")]:
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")
        if len({length for length, _ in self.iso}) != len(self.iso):
            raise ValueError(f"--iso gives one input length twice: {list(self.iso)} (one C per input length)")

    def points(self) -> list[PointSpec]:
        """Every point of one dtype, in run order (duplicates within an experiment dropped)."""
        out = [PointSpec("iso_concurrency", length, c) for length, c in self.iso]
        out += [PointSpec("iso_capacity", length, "max") for length in dict.fromkeys(self.capacity_input_lens)]
        out += [PointSpec("sweep", self.sweep_input_len, c) for c in dict.fromkeys(self.sweep_concurrency)]
        return out


def parse_iso(text: str) -> tuple[int, int | str]:
    """``L:C`` -> (L, C); C may be ``fit``."""
    length, sep, conc = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return int(length), conc if conc == "fit" else int(conc)
    except ValueError:
        raise argparse.ArgumentTypeError(f"--iso takes INPUT_LEN:CONCURRENCY (e.g. 32768:44 or 1000000:fit), "
                                         f"not {text!r}") from None


def add_experiment_args(p: argparse.ArgumentParser) -> None:
    """The options of ``experiments`` (``--launch UP_ARGS...`` is split off before parsing, as for run)."""
    p.description = __doc__
    p.formatter_class = HelpFormatter
    p.epilog = ("--launch UP_ARGS... must come last: every argument after it goes to `nvfp4-serve up` (each "
                "dtype's deployment adds --kv-cache-dtype D). Regenerate the report from a results file with "
                "python -m benchmarks.serving.experiments_report RESULTS.json")
    d = ExperimentPlan(sweep_concurrency=(1,))
    b = d.bench
    w = p.add_argument_group("what runs (per KV dtype, against one deployment)")
    w.add_argument("--kv-dtypes", nargs="+", default=list(d.kv_dtypes), choices=KV_DTYPES,
                   help="one deployment each, in this order (smallest pool first for --iso L:fit)")
    w.add_argument("--iso", type=parse_iso, nargs="+", default=[], metavar="L:C",
                   help="iso-concurrency points: input length L at concurrency C (or 'fit')")
    w.add_argument("--input-lens", type=int, nargs="+", default=[], metavar="L",
                   help="iso-concurrency input lengths, each at --iso-concurrency C (same as --iso L:C ...)")
    w.add_argument("--iso-concurrency", default=None, metavar="C", help="the C of --input-lens (or 'fit')")
    w.add_argument("--capacity-input-lens", type=int, nargs="+", default=[], metavar="L",
                   help="iso-capacity points: each dtype at the largest concurrency its pool holds")
    w.add_argument("--max-concurrency", type=int, default=None,
                   help="cap of the iso-capacity ('max') and the 'fit' concurrencies")
    w.add_argument("--sweep-concurrency", type=int, nargs="+", default=[], metavar="C",
                   help="Pareto sweep concurrencies")
    w.add_argument("--sweep-input-len", type=int, default=d.sweep_input_len,
                   help="prompt tokens of the --sweep-concurrency points")
    w.add_argument("--output-len", type=int, default=d.output_len, help="max_tokens of every request")
    w.add_argument("--prompts-per-concurrency", type=int, default=d.prompts_per_concurrency,
                   help="M: a point at concurrency C sends M x C prompts")
    w.add_argument("--target-input-len", type=int, default=d.target_input_len,
                   help="input length at which the report checks the design targets")
    m = p.add_argument_group("measurement")
    m.add_argument("--seed", type=int, default=b.seed, help="seed of the random prompts")
    m.add_argument("--warmup", type=int, default=b.warmup, help="unmeasured requests before the first point")
    m.add_argument("--peak-window-s", type=float, default=b.peak_window_s, help="peak-batch figure's window")
    m.add_argument("--sample-interval-s", type=float, default=b.sample_interval_s, help="/server_info period")
    m.add_argument("--request-timeout-s", type=float, default=b.request_timeout_s, help="HTTP read timeout")
    m.add_argument("--point-timeout-s", type=float, default=None, help="give up a point after this long")
    m.add_argument("--num-gpus", type=int, default=b.num_gpus, help="GPUs one deployment uses")
    m.add_argument("--save-requests", action=argparse.BooleanOptionalAction, default=False,
                   help="keep per-request timings in the JSON (large)")
    m.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar")
    o = p.add_argument_group("deployment and output")
    o.add_argument("--launch-timeout", type=float, default=900.0, help="seconds to wait for each deployment")
    o.add_argument("--launch-log-dir", default=None, help="launcher logs (default: OUT without .json + -logs)")
    o.add_argument("--api-key", default="", help=f"bearer token (default: ${KEY_ENVS[0]}, the launch args')")
    o.add_argument("--out", default=DEFAULT_OUT, help="the results JSON")
    o.add_argument("--report", default=None, help="markdown report (default: README.md beside --out)")
    o.add_argument("--no-report", dest="write_report", action="store_false", help="JSON only")


def plan_from_args(a: argparse.Namespace) -> ExperimentPlan:
    iso = list(a.iso)
    if a.input_lens:
        if a.iso_concurrency is None:
            raise ValueError("--input-lens needs --iso-concurrency C (or give --iso L:C ...)")
        iso += [parse_iso(f"{length}:{a.iso_concurrency}") for length in a.input_lens]
    elif a.iso_concurrency is not None:
        raise ValueError("--iso-concurrency needs --input-lens L ...")
    bench = BenchConfig(1, 1, 1, 1, seed=a.seed, warmup=a.warmup, peak_window_s=a.peak_window_s,
                        sample_interval_s=a.sample_interval_s, request_timeout_s=a.request_timeout_s,
                        num_gpus=a.num_gpus, save_requests=a.save_requests)
    return ExperimentPlan(
        kv_dtypes=tuple(a.kv_dtypes), iso=tuple(iso), capacity_input_lens=tuple(a.capacity_input_lens),
        sweep_concurrency=tuple(a.sweep_concurrency), sweep_input_len=a.sweep_input_len, output_len=a.output_len,
        prompts_per_concurrency=a.prompts_per_concurrency, max_concurrency=a.max_concurrency,
        target_input_len=a.target_input_len, bench=bench)


def capacity(info: dict[str, Any], input_len: int, output_len: int, launch_args: list[str],
             max_concurrency: int | None) -> dict[str, Any]:
    """The largest concurrency the deployment holds at these lengths, and which limit set it.

    ``pool``: per decode worker floor(pool tokens / (page-rounded (input + output) + one page)), summed;
    ``max_concurrency``: the option; ``router``: its max_concurrent_requests; ``decode``: the decode
    services' --max-running-requests x their number. ``concurrency`` is the smallest, ``limited_by`` its name.
    """
    pool, pages_per_request = 0, None
    for w in info.get("decode", []):
        load = w.get("load") or {}
        page, total = int(load.get("page_size", 0)), int(load.get("max_total_tokens", 0))
        if page > 0:
            pages_per_request = -(-(input_len + output_len) // page) + 1
            pool += total // (pages_per_request * page)
    running = flag_value(launch_args, "--max-running-requests")
    limits = {"pool": pool if pages_per_request is not None else None,
              "max_concurrency": max_concurrency,
              "router": (info.get("config") or {}).get("max_concurrent_requests"),
              "decode": int(running or DEFAULT_MAX_RUNNING_REQUESTS) * max(1, len(info.get("decode", [])))}
    known = {k: int(v) for k, v in limits.items() if v is not None}
    limited_by = min(known, key=lambda k: known[k])
    return {"concurrency": known[limited_by], "limited_by": limited_by, "limits": limits,
            "pages_per_request": pages_per_request}


@dataclass
class _State:
    """What one run carries from dtype to dtype."""

    fit: dict[int, int] = field(default_factory=dict)  # input length -> smallest "fit" C so far


def _resolve(spec: PointSpec, cap: dict[str, Any], state: _State) -> tuple[int, str]:
    """(concurrency, "" or why the point is skipped)."""
    held, pool = cap["concurrency"], cap["limits"]["pool"]
    if spec.concurrency == "max":
        c = held
    elif spec.concurrency == "fit":
        c = min(held, state.fit.get(spec.input_len, held))
        state.fit[spec.input_len] = c
    else:
        c = int(spec.concurrency)
    if c < 1:
        return c, (f"the decode pool holds no request of {spec.input_len} + output tokens "
                   f"(limits: {cap['limits']})")
    if pool is not None and c > pool:
        return c, (f"concurrency {c} needs more than the decode pool holds at {spec.input_len} input tokens "
                   f"({pool} requests): not run; lower it or use 'fit'")
    return c, ""


def _point_record(spec: PointSpec, dtype: str, plan: ExperimentPlan) -> dict[str, Any]:
    return {"experiment": spec.experiment, "kv_dtype": dtype, "input_len": spec.input_len,
            "output_len": plan.output_len, "requested_concurrency": spec.concurrency, "concurrency": None,
            "status": "not run", "error": ""}


async def _run_deployment(base_url: str, launch_args: list[str], dtype: str, plan: ExperimentPlan,
                          state: _State, record: dict[str, Any], api_key: str, progress: bool,
                          point_timeout_s: float | None, save: Callable[[], None]) -> None:
    session = await Session.connect(Target(base_url, api_key=api_key))
    info = session.info
    record.update(gpu=gpu_name(info, base_url, launch_args), deployment=describe_deployment(info, launch_args),
                  num_layers=info.get("num_layers"), server_info=info)
    first = True
    for spec, point in zip(plan.points(), record["points"], strict=True):
        cap = capacity(info, spec.input_len, plan.output_len, launch_args, plan.max_concurrency)
        c, skip = _resolve(spec, cap, state)
        point.update(concurrency=c, capacity=cap)
        if skip:
            point.update(status="skipped", error=skip)
            print(f"[{dtype}] {spec.experiment} L={spec.input_len} C={c}: skipped: {skip}", file=sys.stderr)
            save()
            continue
        cfg = BenchConfig(**{**asdict(plan.bench), "input_len": spec.input_len, "output_len": plan.output_len,
                             "concurrency": c, "num_prompts": c * plan.prompts_per_concurrency,
                             "warmup": plan.bench.warmup if first else 0})
        first = False
        t0 = time.perf_counter()
        try:
            result = await asyncio.wait_for(run_point(session, cfg, progress), point_timeout_s)
            point.update(result, status="ok" if not result["failed"] else "partial")
        except TimeoutError:
            point.update(status="failed", error=f"the point ran past --point-timeout-s {point_timeout_s:g}")
        except Exception as exc:  # noqa: BLE001 - a failed point is recorded, and the next one runs
            point.update(status="failed", error=f"{type(exc).__name__}: {exc}")
        point["wall_s"] = round(time.perf_counter() - t0, 3)
        peak = point.get("peak_decode_tok_s")
        print(f"[{dtype}] {spec.experiment} L={spec.input_len} C={c}: {point['status']}"
              + (f", peak-batch decode {peak:.1f} tok/s" if peak else "")
              + (f" ({point['error']})" if point["error"] else ""), file=sys.stderr, flush=True)
        save()


def run_experiments(plan: ExperimentPlan, launch_args: list[str], argv: list[str], out: str | Path, *,
                    launch_timeout_s: float = 900.0, log_dir: str | Path | None = None, api_key: str = "",
                    progress: bool = True, point_timeout_s: float | None = None,
                    on_deployment_done: Callable[[dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Run the plan (one deployment per dtype, see the module docstring); returns the results document,
    which is also written to ``out`` after every point."""
    if flag_value(launch_args, "--kv-cache-dtype") is not None:
        raise ValueError("the launch args must not set --kv-cache-dtype: experiments sets it per --kv-dtypes")
    out = Path(out)
    log_dir = Path(log_dir) if log_dir else out.with_name(out.stem + "-logs")
    api_key = resolve_api_key(api_key, launch_args)
    doc: dict[str, Any] = {
        "schema": SCHEMA, "created": datetime.now(UTC).isoformat(timespec="seconds"),
        "command": "nvfp4-serve bench " + shlex.join(argv), "argv": list(argv), "launch_args": list(launch_args),
        "plan": {**asdict(plan), "bench": {**asdict(plan.bench), "request_rate": str(plan.bench.request_rate)},
                 "points": [p._asdict() for p in plan.points()]},
        "deployments": [],
    }
    state = _State()

    def save() -> None:
        write_json(doc, out)

    for dtype in plan.kv_dtypes:
        args = [*launch_args, "--kv-cache-dtype", dtype]
        record: dict[str, Any] = {"kv_dtype": dtype, "launch_args": args, "status": "ok", "error": "",
                                  "launch_log": str(log_dir / f"{dtype}.launch.log"),
                                  "points": [_point_record(s, dtype, plan) for s in plan.points()]}
        doc["deployments"].append(record)
        save()
        t0 = time.perf_counter()
        deployment = LaunchedDeployment(args, record["launch_log"], launch_timeout_s)
        try:
            base_url = deployment.start()
            record["launch_s"] = round(time.perf_counter() - t0, 3)
            asyncio.run(_run_deployment(base_url, launch_args, dtype, plan, state, record, api_key, progress,
                                        point_timeout_s, save))
        except Exception as exc:  # noqa: BLE001 - a failed deployment is recorded, and the next dtype runs
            record.update(status="failed", error=f"{type(exc).__name__}: {exc}")
            print(f"[{dtype}] deployment failed: {exc}", file=sys.stderr, flush=True)
            for point in record["points"]:
                if point["status"] == "not run":
                    point["error"] = f"the {dtype} deployment failed: {type(exc).__name__}"
        finally:
            record["exit_code"] = code = deployment.stop()
            record["wall_s"] = round(time.perf_counter() - t0, 3)
            if record["status"] == "ok" and code not in (0, None):  # a service died during the run
                record.update(status="failed", error=f"nvfp4-serve up exited with code {code} (a service died "
                                                     f"during the run?): see {record['launch_log']}")
            save()
        if on_deployment_done is not None:
            on_deployment_done(doc)
    return doc


def main(a: argparse.Namespace, argv: list[str], launch_args: list[str] | None) -> int:
    """``experiments`` of ``python -m benchmarks.serving`` (parsed options, raw argv, args after --launch)."""
    if launch_args is None:
        print("experiments starts one deployment per KV dtype: give --launch [nvfp4-serve up args...] last",
              file=sys.stderr)
        return 2
    try:
        plan = plan_from_args(a)
    except ValueError as exc:
        print(f"experiments: {exc}", file=sys.stderr)
        return 2
    from benchmarks.serving import experiments_report

    report = a.report or str(Path(a.out).with_name("README.md"))

    def write_report(doc: dict[str, Any]) -> None:
        if a.write_report:
            experiments_report.write_report(doc, a.out, report)

    try:
        doc = run_experiments(plan, launch_args, argv, a.out, launch_timeout_s=a.launch_timeout,
                              log_dir=a.launch_log_dir, api_key=a.api_key, progress=a.progress,
                              point_timeout_s=a.point_timeout_s, on_deployment_done=write_report)
    except ValueError as exc:
        print(f"experiments: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"experiments interrupted; results so far: {Path(a.out).resolve()}", file=sys.stderr)
        return 130
    doc["summary"] = experiments_report.summarize(doc)
    write_json(doc, a.out)
    print(f"results: {Path(a.out).resolve()}")
    if a.write_report:
        print(f"report: {Path(report).resolve()}")
    failed = [f"{d['kv_dtype']} deployment" for d in doc["deployments"] if d["status"] != "ok"]
    failed += [f"{p['kv_dtype']} {p['experiment']} L={p['input_len']} C={p['concurrency']} ({p['status']})"
               for d in doc["deployments"] if d["status"] == "ok" for p in d["points"]
               if p["status"] in ("failed", "partial")]
    if failed:
        print("not everything ran cleanly (errors are in the JSON and the report): " + "; ".join(failed),
              file=sys.stderr)
    return 1 if failed else 0
