"""Synthetic coding-agent traces: ``nvfp4-serve bench gen-trace --out trace.jsonl [options]``.

The shape modelled (defaults; every number is an option):

- every session starts from the same **system prompt + tool schemas** (12,000 tokens: the size of a coding
  agent's instructions plus a dozen JSON tool schemas), then the user's **task** (lognormal, median 400
  tokens);
- then the agent loops: it **answers** (reasoning + a tool call; lognormal, median 220 tokens, sigma 0.7,
  at most 4,000), the tool runs for the **think time** (lognormal, median 1.5 s, sigma 1.0, at most 120 s) and
  its **result** is appended (file reads, grep hits, test logs: lognormal, median 900 tokens, sigma 1.1,
  20..24,000 tokens, so a few results are huge); 8% of the turns are a short **user** follow-up instead
  (median 80 tokens, after a median of 20 s);
- a session runs 20..80 turns (uniform) and stops early before its context (prompt + answer) would pass
  131,072 tokens: a mean growth of ~1.9K tokens per turn takes most sessions past 100K tokens.

These are assumptions chosen to give the growth pattern of coding-agent sessions (a long shared prefix, contexts
growing turn after turn to 100K+, tool results of very varied size, short user turns), not a fit to a
recorded dataset. ``--scale`` multiplies every token count (and the context cap) after the session structure
is drawn, so a scaled trace has the same sessions, turns and kinds as the full one; ``--think-time-scale``
does the same for think times (0 for a benchmark that should not wait).

``--fit-pool-tokens P --saturate-at C`` sizes sessions for a deployment instead: each session grows to
about P / C tokens (the cap), so C sessions started together fill a decode pool of P tokens (read P from the
FP8 deployment's ``/server_info``: ``decode[*].load.max_total_tokens``, summed over the decode workers);
``--turns-to-fill T`` sets the tool-result size so that this takes about T turns. Staggered sessions hold
on average about half their final context, so with a steady stream of sessions the pool fills at up to ~2C.

Everything derives from ``--seed``: session i is drawn from its own generator stream, so the first N sessions
of a larger trace are the N sessions of a smaller one.
"""

from __future__ import annotations

import argparse
import math
import sys
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

import numpy as np

from benchmarks.agentic.trace import SessionTrace, Trace, Turn, save
from svc_common.cli_help import HelpFormatter


def _opt(help_text: str) -> dict[str, str]:
    return {"help": help_text}


@dataclass(frozen=True)
class AgentTraceConfig:
    """Parameters of a synthetic coding-agent trace (see the module docstring for what they model)."""

    num_sessions: int = field(default=32, metadata=_opt("sessions in the trace"))
    min_turns: int = field(default=20, metadata=_opt("fewest turns of a session (if the context cap allows)"))
    max_turns: int = field(default=80, metadata=_opt("most turns of a session"))
    shared_prefix_tokens: int = field(default=12000, metadata=_opt("system prompt + tool schemas, shared"))
    first_user_median: int = field(default=400, metadata=_opt("the task message: lognormal median (tokens)"))
    first_user_sigma: float = field(default=0.6, metadata=_opt("the task message: lognormal sigma"))
    user_turn_prob: float = field(default=0.08, metadata=_opt("chance that a later turn is a user message"))
    user_median: int = field(default=80, metadata=_opt("user follow-up: lognormal median (tokens)"))
    user_sigma: float = field(default=0.8, metadata=_opt("user follow-up: lognormal sigma"))
    tool_result_median: int = field(default=900, metadata=_opt("tool result: lognormal median (tokens)"))
    tool_result_sigma: float = field(default=1.1, metadata=_opt("tool result: lognormal sigma"))
    tool_result_min: int = field(default=20, metadata=_opt("tool result: smallest (tokens)"))
    tool_result_max: int = field(default=24000, metadata=_opt("tool result: largest (tokens)"))
    output_median: int = field(default=220, metadata=_opt("answer: lognormal median (tokens)"))
    output_sigma: float = field(default=0.7, metadata=_opt("answer: lognormal sigma"))
    output_max: int = field(default=4000, metadata=_opt("answer: largest (tokens)"))
    think_time_median_s: float = field(default=1.5, metadata=_opt("tool run time: lognormal median (s)"))
    think_time_sigma: float = field(default=1.0, metadata=_opt("tool run time: lognormal sigma"))
    user_think_time_median_s: float = field(default=20.0, metadata=_opt("user typing time: lognormal median"))
    think_time_max_s: float = field(default=120.0, metadata=_opt("longest think time (s)"))
    max_context_tokens: int = field(default=131072, metadata=_opt("a session stops before passing this"))
    fill_to_cap: bool = field(default=False, metadata=_opt("shorten the turn that would pass the cap to end "
                                                            "exactly there (every session reaches the cap)"))
    scale: float = field(default=1.0, metadata=_opt("multiply every token count (CPU runs: e.g. 0.01)"))
    think_time_scale: float = field(default=1.0, metadata=_opt("multiply every think time (0: no waiting)"))
    seed: int = field(default=0, metadata=_opt("the trace's seed (lengths and token ids)"))

    def __post_init__(self) -> None:
        positive = ("num_sessions", "min_turns", "max_turns", "first_user_median", "user_median",
                    "tool_result_median", "tool_result_min", "tool_result_max", "output_median", "output_max",
                    "max_context_tokens")
        for name in positive:
            if getattr(self, name) < 1:
                raise ValueError(f"--{_flag(name)} must be >= 1, got {getattr(self, name)}")
        for name in ("shared_prefix_tokens", "seed"):
            if getattr(self, name) < 0:
                raise ValueError(f"--{_flag(name)} must be >= 0, got {getattr(self, name)}")
        if self.min_turns > self.max_turns:
            raise ValueError(f"--min-turns ({self.min_turns}) must be <= --max-turns ({self.max_turns})")
        if self.tool_result_min > self.tool_result_max:
            raise ValueError(f"--tool-result-min ({self.tool_result_min}) must be <= --tool-result-max "
                             f"({self.tool_result_max})")
        if not 0.0 <= self.user_turn_prob <= 1.0:
            raise ValueError(f"--user-turn-prob must be in [0, 1], got {self.user_turn_prob}")
        for name in ("first_user_sigma", "user_sigma", "tool_result_sigma", "output_sigma",
                     "think_time_sigma", "think_time_median_s", "user_think_time_median_s",
                     "think_time_max_s", "think_time_scale"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value >= 0):
                raise ValueError(f"--{_flag(name)} must be a finite number >= 0, got {value}")
        if not (math.isfinite(self.scale) and self.scale > 0):
            raise ValueError(f"--scale must be > 0, got {self.scale}")
        first = self.shared_prefix_tokens + self.first_user_median + self.output_median
        if first > self.max_context_tokens:
            raise ValueError(f"a session's first turn (shared prefix {self.shared_prefix_tokens} + task "
                             f"{self.first_user_median} + answer {self.output_median} tokens) does not fit "
                             f"--max-context-tokens {self.max_context_tokens}: raise it or shrink the prefix")


def _flag(name: str) -> str:
    return name.replace("_", "-")


def fit_to_pool(cfg: AgentTraceConfig, pool_tokens: int, saturate_at: int,
                turns_to_fill: int) -> AgentTraceConfig:
    """``cfg`` with sessions sized so that ``saturate_at`` full sessions fill a pool of ``pool_tokens``: the
    shared prefix is cached once, so each session grows to ``shared + (pool_tokens - shared) // saturate_at``
    tokens, in about ``turns_to_fill`` turns (the cap ends each session, not the turn count); token counts are
    then in server tokens (scale 1).

    The tool-result median is solved from the mean growth per turn: (1-p) E[tool] + p E[user] + E[answer],
    with E[lognormal] = median * exp(sigma^2 / 2)."""
    if pool_tokens < 1 or saturate_at < 1 or turns_to_fill < 1:
        raise ValueError(f"--fit-pool-tokens, --saturate-at and --turns-to-fill must be >= 1 (got "
                         f"{pool_tokens}, {saturate_at}, {turns_to_fill})")
    if pool_tokens <= cfg.shared_prefix_tokens:
        raise ValueError(f"--fit-pool-tokens {pool_tokens} does not exceed the shared prefix of "
                         f"{cfg.shared_prefix_tokens} tokens")
    cap = cfg.shared_prefix_tokens + (pool_tokens - cfg.shared_prefix_tokens) // saturate_at
    room = cap - cfg.shared_prefix_tokens - cfg.first_user_median
    p = cfg.user_turn_prob
    growth = room / turns_to_fill
    mean_out = cfg.output_median * math.exp(cfg.output_sigma ** 2 / 2)
    mean_user = cfg.user_median * math.exp(cfg.user_sigma ** 2 / 2)
    mean_tool = (growth - mean_out - p * mean_user) / max(1e-9, 1.0 - p)
    median = int(mean_tool / math.exp(cfg.tool_result_sigma ** 2 / 2))
    if median < 1:
        raise ValueError(f"sessions of {cap} tokens (pool {pool_tokens}, saturated by {saturate_at}) cannot take "
                         f"{turns_to_fill} turns of answers of median {cfg.output_median} tokens after a "
                         f"shared prefix of {cfg.shared_prefix_tokens}: lower --turns-to-fill, "
                         "--output-median or --shared-prefix-tokens")
    return replace(cfg, max_context_tokens=cap, tool_result_median=median,
                   tool_result_min=min(cfg.tool_result_min, median),
                   tool_result_max=max(cfg.tool_result_max, 20 * median),
                   min_turns=10 * turns_to_fill, max_turns=10 * turns_to_fill, fill_to_cap=True, scale=1.0)


def _lognormal(rng: np.random.Generator, median: float, sigma: float, lo: float, hi: float) -> float:
    return float(np.clip(rng.lognormal(math.log(median), sigma), lo, hi))


def _session(cfg: AgentTraceConfig, index: int) -> list[tuple[str, int, int, float]]:
    """(kind, new tokens, output tokens, think time) per turn, unscaled."""
    rng = np.random.default_rng([cfg.seed, 1, index])
    num_turns = int(rng.integers(cfg.min_turns, cfg.max_turns + 1))
    out: list[tuple[str, int, int, float]] = []
    ctx = cfg.shared_prefix_tokens
    for t in range(num_turns):
        answer = round(_lognormal(rng, cfg.output_median, cfg.output_sigma, 1, cfg.output_max))
        if t == 0:
            kind = "user"
            new = round(_lognormal(rng, cfg.first_user_median, cfg.first_user_sigma, 1,
                                   16 * cfg.first_user_median))
            think = 0.0
        elif rng.random() < cfg.user_turn_prob:
            kind = "user"
            new = round(_lognormal(rng, cfg.user_median, cfg.user_sigma, 1, 16 * cfg.user_median))
            think = _lognormal(rng, cfg.user_think_time_median_s, cfg.think_time_sigma, 0,
                               cfg.think_time_max_s)
        else:
            kind = "tool_result"
            new = round(_lognormal(rng, cfg.tool_result_median, cfg.tool_result_sigma, cfg.tool_result_min,
                                   cfg.tool_result_max))
            think = _lognormal(rng, cfg.think_time_median_s, cfg.think_time_sigma, 0, cfg.think_time_max_s)
        if ctx + new + answer > cfg.max_context_tokens:
            room = cfg.max_context_tokens - ctx - answer
            if t == 0 or (cfg.fill_to_cap and room >= 1):  # the first turn must exist
                out.append((kind, max(1, room), answer, think))
            break
        out.append((kind, new, answer, think))
        ctx += new + answer
    return out


def generate(cfg: AgentTraceConfig) -> Trace:
    """The trace of ``cfg`` (deterministic in ``cfg``; see the module docstring)."""

    def scaled(n: int) -> int:
        return max(1, round(n * cfg.scale))

    sessions = []
    width = max(4, len(str(cfg.num_sessions - 1)))
    for i in range(cfg.num_sessions):
        sid = f"s{i:0{width}d}"
        turns = tuple(Turn(sid, t, kind, scaled(answer), round(think * cfg.think_time_scale, 3), scaled(new))
                      for t, (kind, new, answer, think) in enumerate(_session(cfg, i)))
        sessions.append(SessionTrace(sid, turns))
    shared = round(cfg.shared_prefix_tokens * cfg.scale) if cfg.shared_prefix_tokens else 0
    record: dict[str, Any] = {"name": "coding-agent", **asdict(cfg)}
    return Trace(tuple(sessions), shared, None, cfg.seed, record)


# --------------------------------------------------------------------------------------------- CLI


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nvfp4-serve bench gen-trace", description=__doc__,
                                formatter_class=HelpFormatter)
    p.add_argument("--out", required=True, help="trace file to write (JSONL)")
    d = AgentTraceConfig()
    g = p.add_argument_group("trace shape")
    for f in fields(AgentTraceConfig):
        default = getattr(d, f.name)
        kind: dict[str, Any] = ({"action": argparse.BooleanOptionalAction} if isinstance(default, bool)
                                else {"type": type(default)})
        g.add_argument(f"--{_flag(f.name)}", default=default,
                       help=f"{f.metadata['help']} (default {default})", **kind)
    fit = p.add_argument_group("fit to a deployment (overrides the context cap, the tool-result size and "
                               "--scale)")
    fit.add_argument("--fit-pool-tokens", type=int, default=None,
                     help="decode pool tokens of the deployment that should saturate (FP8's)")
    fit.add_argument("--saturate-at", type=int, default=12, help="sessions that together fill that pool")
    fit.add_argument("--turns-to-fill", type=int, default=12, help="turns a session takes to reach its cap")
    return p


def main(argv: list[str] | None = None) -> int:
    a = build_parser().parse_args(argv)
    try:
        cfg = AgentTraceConfig(**{f.name: getattr(a, f.name) for f in fields(AgentTraceConfig)})
        if a.fit_pool_tokens is not None:
            cfg = fit_to_pool(cfg, a.fit_pool_tokens, a.saturate_at, a.turns_to_fill)
        trace = generate(cfg)
    except ValueError as exc:
        print(f"gen-trace: {exc}", file=sys.stderr)
        return 2
    path = save(trace, a.out)
    s = trace.stats()
    final, turns = s["final_context_tokens"], s["turns_per_session"]
    print(f"{path}: {s['num_sessions']} sessions, {s['num_turns']} turns (per session {turns['min']}.."
          f"{turns['max']}, mean {turns['mean']:.1f}); shared prefix {s['shared_prefix_tokens']} tokens; "
          f"final context mean {final['mean']:.0f}, max {final['max']} tokens; {s['total_prompt_tokens']} "
          f"prompt and {s['total_output_tokens']} output tokens in all")
    return 0


if __name__ == "__main__":
    sys.exit(main())
