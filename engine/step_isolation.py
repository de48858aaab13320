"""After a failed batch, each request's part run on its own, so that only the request(s) whose own part fails end.

Only a failure raised before the device work (bad ids, shapes) can be isolated; a device fault is fatal. A request
whose own part fails is handed to ``fail`` with the failure; the others get what the batch would have given them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from engine.model_runner import ModelRunner
from engine.outcome import Failure, failure_of
from engine.request import Request

log = logging.getLogger(__name__)

OnFailure = Callable[[Request, Failure], None]


def decode_each(runner: ModelRunner, batch: Sequence[Request], fail: OnFailure) -> tuple[list[Request], list[int]]:
    """Each request's decode step on its own (read before the next): the requests that got a token, and theirs."""
    ok, tokens = [], []
    for req in batch:
        try:
            tokens += runner.decode([req])
            ok.append(req)
        except Exception as e:  # noqa: BLE001 - this request's own failure
            log.warning("request %s failed its decode step and is ended: %s: %s", req.rid, type(e).__name__, e)
            fail(req, failure_of(e, "engine error in this request's decode step: "))
    return ok, tokens


def extend_each(runner: ModelRunner, batch: Sequence[Request], lens: Sequence[int], sample_mask: Sequence[bool],
                fail: OnFailure) -> tuple[list[Request], list[int], list[int | None]]:
    """Each request's prefill chunk on its own (it rewrites only its own pages): the requests that ran, their
    lengths and their sampled tokens (None where not sampled)."""
    ok, ok_lens, tokens = [], [], []
    for req, n, m in zip(batch, lens, sample_mask, strict=True):
        try:
            tokens += runner.extend([req], [n], [m])
            ok.append(req)
            ok_lens.append(n)
        except Exception as e:  # noqa: BLE001 - this request's own failure
            log.warning("request %s failed its prefill chunk and is ended: %s: %s", req.rid, type(e).__name__, e)
            fail(req, failure_of(e, "engine error in this request's prefill: "))
    return ok, ok_lens, tokens
