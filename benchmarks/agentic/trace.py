"""The multi-turn trace format: JSONL, one header line, then one line per turn.

    {"schema": "nvfp4-serve/agentic-trace/1", "shared_prefix_tokens": 12000, "seed": 0, "generator": {...}}
    {"session_id": "s0000", "turn": 0, "kind": "user", "new_tokens": 420, "output_tokens": 180,
     "think_time_s": 0}
    {"session_id": "s0000", "turn": 1, "kind": "tool_result", "new_tokens": 1834, "output_tokens": 95,
     "think_time_s": 1.7}
    ...

What the replayer sends (token ids; see ``benchmarks.agentic.prompts``)::

    turn 0 prompt   = shared prefix | new(0)
    turn t+1 prompt = turn t prompt | turn t output ids (as generated) | new(t+1)

- ``shared_prefix_tokens``: the system prompt and tool schemas, the SAME ids in every session (so sessions
  share a cached prefix). The header may give ``shared_prefix_text`` instead (tokenized by the replayer).
- ``new_tokens``: how many ids this turn appends after the previous answer (the user's message or the tool
  result); a turn may give ``text`` instead (tokenized by the replayer with the model's tokenizer, no special
  tokens). ``kind`` says which it is ("user" or "tool_result").
- ``output_tokens``: the answer's length (``max_tokens``, exact: the replayer sets ``ignore_eos``).
- ``think_time_s``: the wait between the previous answer and this turn's request (tool run time or the user
  typing); turn 0's is a delay before the session's first request.
- ``seed``: the ids of the shared prefix and of every (session, turn) segment derive from it, so a replay is
  the same on every machine. ``generator``: the parameters that made the trace (free-form, for the record).

Turns of a session may be spread over the file but must be numbered 0, 1, 2, ... without gaps; sessions
are replayed in the order of their first line. Every error names the file and line.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = "nvfp4-serve/agentic-trace/1"
TURN_KINDS = ("user", "tool_result")
MAX_SESSION_ID_LEN = 128


class TraceError(ValueError):
    """A trace file (or trace object) that breaks the format; the message names the line."""


@dataclass(frozen=True)
class Turn:
    """One request of a session: append ``new_tokens`` ids (or ``text``), generate ``output_tokens``."""

    session_id: str
    turn: int
    kind: str
    output_tokens: int
    think_time_s: float = 0.0
    new_tokens: int | None = None
    text: str | None = None

    def __post_init__(self) -> None:
        sid = self.session_id
        if not isinstance(sid, str) or not sid or len(sid) > MAX_SESSION_ID_LEN or not sid.isprintable():
            raise TraceError(f"session_id must be a printable string of 1..{MAX_SESSION_ID_LEN} characters, "
                             f"got {sid!r}")
        _check_int("turn", self.turn, 0)
        if self.kind not in TURN_KINDS:
            raise TraceError(f"kind must be one of {TURN_KINDS}, got {self.kind!r}")
        _check_int("output_tokens", self.output_tokens, 1)
        t = self.think_time_s
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise TraceError(f"think_time_s must be a finite number >= 0, got {t!r}")
        if (self.new_tokens is None) == (self.text is None):
            raise TraceError("a turn gives exactly one of new_tokens (a count) and text")
        if self.new_tokens is not None:
            _check_int("new_tokens", self.new_tokens, 1)
        elif not isinstance(self.text, str) or not self.text:
            raise TraceError(f"text must be a non-empty string, got {self.text!r}")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"session_id": self.session_id, "turn": self.turn, "kind": self.kind}
        out.update({"new_tokens": self.new_tokens} if self.text is None else {"text": self.text})
        out.update(output_tokens=self.output_tokens, think_time_s=round(float(self.think_time_s), 3))
        return out


@dataclass(frozen=True)
class SessionTrace:
    """The turns of one session, turn indices 0..n-1."""

    session_id: str
    turns: tuple[Turn, ...]

    def __post_init__(self) -> None:
        if not self.turns:
            raise TraceError(f"session {self.session_id!r} has no turn")
        for i, t in enumerate(self.turns):
            if t.session_id != self.session_id or t.turn != i:
                raise TraceError(f"session {self.session_id!r}: turn {i} is {t.session_id!r} turn {t.turn}")

    def context_lens(self, shared_prefix_tokens: int) -> list[int]:
        """Tokens of the context after each turn's answer (prompt + output); needs counts, not text."""
        out, ctx = [], shared_prefix_tokens
        for t in self.turns:
            if t.new_tokens is None:
                raise TraceError(f"session {self.session_id!r} turn {t.turn} gives text: its length in "
                                 "tokens needs the tokenizer")
            ctx += t.new_tokens + t.output_tokens
            out.append(ctx)
        return out


@dataclass(frozen=True)
class Trace:
    """A header and sessions in replay order."""

    sessions: tuple[SessionTrace, ...]
    shared_prefix_tokens: int = 0
    shared_prefix_text: str | None = None
    seed: int = 0
    generator: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_int("shared_prefix_tokens", self.shared_prefix_tokens, 0)
        text = self.shared_prefix_text
        if text is not None and (self.shared_prefix_tokens or not isinstance(text, str) or not text):
            raise TraceError("the header gives at most one of shared_prefix_tokens and shared_prefix_text (a "
                             "non-empty string)")
        _check_int("seed", self.seed, 0)
        if not self.sessions:
            raise TraceError("the trace has no session")
        ids = [s.session_id for s in self.sessions]
        if len(set(ids)) != len(ids):
            dup = next(i for i in ids if ids.count(i) > 1)
            raise TraceError(f"session {dup!r} appears twice")

    @property
    def num_turns(self) -> int:
        return sum(len(s.turns) for s in self.sessions)

    def head(self, num_sessions: int) -> Trace:
        """The first ``num_sessions`` sessions (all when there are fewer)."""
        return Trace(self.sessions[:num_sessions], self.shared_prefix_tokens, self.shared_prefix_text,
                     self.seed, self.generator)

    def header_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"schema": SCHEMA}
        if self.shared_prefix_text is not None:
            out["shared_prefix_text"] = self.shared_prefix_text
        else:
            out["shared_prefix_tokens"] = self.shared_prefix_tokens
        out.update(seed=self.seed, generator=self.generator)
        return out

    def stats(self) -> dict[str, Any]:
        """Counts and token statistics (token-count traces only; text turns are left out of the sums)."""
        counted = [s for s in self.sessions if all(t.new_tokens is not None for t in s.turns)]
        finals = [s.context_lens(self.shared_prefix_tokens)[-1] for s in counted]
        turns = [t for s in self.sessions for t in s.turns]
        by_kind = {k: [t.new_tokens for t in turns if t.kind == k and t.new_tokens is not None]
                   for k in TURN_KINDS}
        outputs = [t.output_tokens for t in turns]
        thinks = [t.think_time_s for t in turns if t.turn > 0]
        # Prompt tokens summed over every request (what a cache-less server would prefill).
        prompt_sum = 0
        for s in counted:
            ctx = self.shared_prefix_tokens
            for t in s.turns:
                prompt_sum += ctx + (t.new_tokens or 0)
                ctx += (t.new_tokens or 0) + t.output_tokens
        return {
            "num_sessions": len(self.sessions), "num_turns": len(turns),
            "turns_per_session": _summary([len(s.turns) for s in self.sessions]),
            "shared_prefix_tokens": self.shared_prefix_tokens,
            "final_context_tokens": _summary(finals),
            "tool_result_tokens": _summary(by_kind["tool_result"]), "user_tokens": _summary(by_kind["user"]),
            "output_tokens": _summary(outputs), "think_time_s": _summary(thinks),
            "total_prompt_tokens": prompt_sum, "total_output_tokens": sum(outputs),
        }


def _summary(values: Sequence[float]) -> dict[str, float | None]:
    if not values:
        return {"mean": None, "median": None, "min": None, "max": None}
    v = sorted(values)
    mid = len(v) // 2
    median = v[mid] if len(v) % 2 else (v[mid - 1] + v[mid]) / 2
    return {"mean": sum(v) / len(v), "median": median, "min": v[0], "max": v[-1]}


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise TraceError(f"{name} must be an integer >= {minimum}, got {value!r}")


_TURN_KEYS = {"session_id", "turn", "kind", "new_tokens", "text", "output_tokens", "think_time_s"}
_HEADER_KEYS = {"schema", "shared_prefix_tokens", "shared_prefix_text", "seed", "generator"}


def dumps(trace: Trace) -> str:
    """The JSONL text of ``trace`` (sessions one after the other)."""
    lines = [json.dumps(trace.header_json(), separators=(",", ":"))]
    lines += [json.dumps(t.to_json(), separators=(",", ":")) for s in trace.sessions for t in s.turns]
    return "\n".join(lines) + "\n"


def save(trace: Trace, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(trace))
    return path


def load(path: str | Path) -> Trace:
    """Read and validate a trace file; TraceError names ``path:line`` on any problem."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror or exc}") from None
    return parse(text.splitlines(), str(path))


def parse(lines: Iterable[str], source: str = "<trace>") -> Trace:
    """Validate JSONL lines (blank lines are skipped) into a Trace."""
    header: dict[str, Any] | None = None
    turns: dict[str, dict[int, tuple[Turn, int]]] = {}  # session -> turn -> (turn, line number)
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        where = f"{source}:{number}"
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise TraceError(f"{where}: not valid JSON ({exc.msg})") from None
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: each line must be a JSON object")
        if header is None:
            header = _header(obj, where)
            continue
        unknown = sorted(set(obj) - _TURN_KEYS)
        if unknown:
            raise TraceError(f"{where}: unknown key(s) {unknown} (a turn has {sorted(_TURN_KEYS)})")
        missing = sorted({"session_id", "turn", "kind", "output_tokens"} - set(obj))
        if missing:
            raise TraceError(f"{where}: missing key(s) {missing}")
        try:
            turn = Turn(**obj)
        except TraceError as exc:
            raise TraceError(f"{where}: {exc}") from None
        seen = turns.setdefault(turn.session_id, {})
        if turn.turn in seen:
            raise TraceError(f"{where}: session {turn.session_id!r} turn {turn.turn} already given on line "
                             f"{seen[turn.turn][1]}")
        seen[turn.turn] = (turn, number)
    if header is None:
        raise TraceError(f"{source}: empty trace (the first line must be the header with schema {SCHEMA!r})")
    sessions = []
    for sid, by_index in turns.items():
        for i in range(len(by_index)):
            if i not in by_index:
                after = max(k for k in by_index if k < i) if i else None
                line = by_index[after][1] if after is not None else min(n for _, n in by_index.values())
                raise TraceError(f"{source}:{line}: session {sid!r} has no turn {i} (turns are numbered 0, "
                                 f"1, 2, ... without gaps; it has {sorted(by_index)[:8]}...)")
        sessions.append(SessionTrace(sid, tuple(by_index[i][0] for i in range(len(by_index)))))
    try:
        return Trace(tuple(sessions), **header)
    except TraceError as exc:
        raise TraceError(f"{source}: {exc}") from None


def _header(obj: dict[str, Any], where: str) -> dict[str, Any]:
    if obj.get("schema") != SCHEMA:
        raise TraceError(f"{where}: the first line must be the header with \"schema\": {SCHEMA!r} "
                         f"(got {obj.get('schema')!r}); was this file written by "
                         "`nvfp4-serve bench gen-trace`?")
    unknown = sorted(set(obj) - _HEADER_KEYS)
    if unknown:
        raise TraceError(f"{where}: unknown header key(s) {unknown} (the header has {sorted(_HEADER_KEYS)})")
    out = {k: v for k, v in obj.items() if k != "schema"}
    if not isinstance(out.get("generator", {}), dict):
        raise TraceError(f"{where}: generator must be a JSON object")
    for name in ("shared_prefix_tokens", "seed"):
        if name in out:
            try:
                _check_int(name, out[name], 0)
            except TraceError as exc:
                raise TraceError(f"{where}: {exc}") from None
    return out
