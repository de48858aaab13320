"""Faults the tests inject into real service processes (``--debug-*-delay-s``, for tests only).

Delays that trip the deadlines of a KV transfer or of a token stream, or keep requests in flight while a test
fills the queues. All zero in a deployment, and then nothing on the serving path looks at them: the decode
wraps its engine callback once, at construction, only when a token delay is set (``stall_after_tokens``).
The flags are declared once, on the fields below (flag name, the service that takes it, help).
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

from engine.request import PullStart, StepOutput

GROUP_TITLE = "fault injection (for tests only; off by default)"


def _knob(service: str, help_text: str) -> Any:
    return field(default=0.0, metadata={"service": service, "help": help_text})


@dataclass(frozen=True)
class FaultInjection:
    """Test-only delays, in seconds (0: off)."""

    header_delay_s: float = _knob(
        "prefill", "testing only: sleep before the transfer header (to trip the decode's first-message deadline)")
    transfer_delay_s: float = _knob(
        "prefill", "testing only: sleep before each KV page message (to kill a prefill mid-transfer)")
    done_delay_s: float = _knob(
        "prefill", "testing only: sleep after PrefillDone before the transfer stream ends (a decode that cancels "
        "the stream of a completed transfer then ends it as a failure)")
    token_delay_s: float = _knob(
        "decode", "testing only: stall the engine loop after each token it produces (to trip token deadlines)")

    def __post_init__(self) -> None:
        for f in fields(self):
            value = getattr(self, f.name)
            if value < 0:
                raise ValueError(f"{_flag(f.name)} must be >= 0, got {value}")

    def stall_after_tokens(
            self, callback: Callable[[StepOutput | PullStart], None]) -> Callable[[StepOutput | PullStart], None]:
        """``callback`` itself without a token delay; else the callback followed, after each output that carries
        a token and does not finish its request, by a sleep on the engine loop's thread (the whole loop stalls)."""
        delay = self.token_delay_s
        if not delay:
            return callback

        def stalled(ev: StepOutput | PullStart) -> None:
            callback(ev)
            if isinstance(ev, StepOutput) and ev.new_token_ids and not ev.finish_reason:
                time.sleep(delay)

        return stalled


def _flag(name: str) -> str:
    return "--debug-" + name.replace("_", "-")


def add_fault_args(parser: argparse.ArgumentParser, service: str) -> None:
    """The ``--debug-*-delay-s`` flags of ``service`` ("prefill" or "decode"), in their own group."""
    g = parser.add_argument_group(GROUP_TITLE)
    for f in fields(FaultInjection):
        if f.metadata["service"] == service:
            g.add_argument(_flag(f.name), dest="debug_" + f.name, type=float, default=f.default,
                           help=f.metadata["help"])


def faults_from_args(a: argparse.Namespace) -> FaultInjection:
    """The faults of parsed flags (the flags a service does not take stay 0)."""
    return FaultInjection(**{f.name: getattr(a, "debug_" + f.name) for f in fields(FaultInjection)
                             if hasattr(a, "debug_" + f.name)})
