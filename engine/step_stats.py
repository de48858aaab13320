"""Where an engine loop's time goes, logged every ``interval_s`` (as SGLang logs its decode batches).

For each loop iteration that ran a step the loop adds its wall time, and the decode tokens it produced;
the model runner adds up the time reading a decode step's tokens blocked on the device
(``ModelRunner.decode_wait_s``). Host time = iteration time - device wait: scheduling, staging, graph launch,
streaming the tokens and waiting for the GIL. Without overlap scheduling the GPU is idle for all of it: it is what
a step costs on top of the kernels. With overlap the next step is already queued while it runs, so it costs the
GPU nothing as long as it stays below the step's device time (the device wait then stays above zero).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class StepSummary:
    seconds: float  # wall time the summary covers
    iterations: int  # loop iterations that ran a step
    decode_steps: int
    decode_tokens: int
    busy_s: float  # wall time inside those iterations
    device_wait_s: float  # of which decode waited for its sampled tokens

    @property
    def host_ms_per_step(self) -> float:
        return 1e3 * (self.busy_s - self.device_wait_s) / max(1, self.iterations)

    def line(self) -> str:
        it = max(1, self.iterations)
        return (f"engine: {self.decode_tokens / self.seconds:.0f} decode tok/s, {self.decode_steps / self.seconds:.1f} "
                f"decode steps/s, mean batch {self.decode_tokens / max(1, self.decode_steps):.1f}; per iteration "
                f"{1e3 * self.busy_s / it:.2f} ms = device wait {1e3 * self.device_wait_s / it:.2f} ms + host "
                f"{self.host_ms_per_step:.2f} ms; busy {100 * self.busy_s / self.seconds:.0f}% of {self.seconds:.0f} s")


class StepStats:
    """Accumulates iterations; ``poll(now, device_wait_total)`` returns a summary once per interval."""

    def __init__(self, interval_s: float, start: float, device_wait_total: float = 0.0) -> None:
        if interval_s <= 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s}")
        self.interval_s = interval_s
        self._reset(start, device_wait_total)

    def _reset(self, now: float, device_wait_total: float) -> None:
        self._t0, self._wait0 = now, device_wait_total
        self._iterations = self._steps = self._tokens = 0
        self._busy = 0.0

    def add(self, busy_s: float, decode_tokens: int) -> None:
        self._iterations += 1
        self._busy += busy_s
        if decode_tokens:
            self._steps += 1
            self._tokens += decode_tokens

    def poll(self, now: float, device_wait_total: float) -> StepSummary | None:
        """A summary of the interval that just ended (None before its end, or when it ran nothing)."""
        if now - self._t0 < self.interval_s:
            return None
        out = None
        if self._iterations:
            out = StepSummary(now - self._t0, self._iterations, self._steps, self._tokens, self._busy,
                              device_wait_total - self._wait0)
        self._reset(now, device_wait_total)
        return out
