"""The decode worker's message coalescing: tokens queued behind the one being sent go out with it."""

from __future__ import annotations

import asyncio

from decode_svc.worker import _coalesce
from engine.outcome import Failure, FailureKind, FinishReason
from engine.request import PullStart, StepOutput


def _queue(*items):
    q: asyncio.Queue = asyncio.Queue()
    for it in items:
        q.put_nowait(it)
    return q


def test_queued_tokens_join_the_message_up_to_the_finish_and_nothing_after_it_is_taken():
    q = _queue(StepOutput("r", [2], None, 9, 4), StepOutput("r", [3], FinishReason.LENGTH, 9, 4),
               StepOutput("r", [7], None, 9, 4))
    ev = _coalesce(StepOutput("r", [1], None, 9, 4), q)
    assert (ev.new_token_ids, ev.finish_reason) == ([1, 2, 3], FinishReason.LENGTH)
    assert (ev.num_prompt_tokens, ev.num_cached_tokens) == (9, 4)
    assert q.qsize() == 1  # the finish ends the merge


def test_an_error_behind_tokens_is_kept_and_a_lone_event_is_returned_as_is():
    boom = Failure(FailureKind.INTERNAL, "engine error: boom")
    q = _queue(StepOutput("r", [], FinishReason.ABORT, 9, 0, failure=boom), StepOutput("r", [5], None, 9, 0))
    ev = _coalesce(StepOutput("r", [1], None, 9, 0), q)
    assert (ev.new_token_ids, ev.finish_reason, ev.failure) == ([1], FinishReason.ABORT, boom)
    assert q.qsize() == 1
    lone = StepOutput("r", [8], None, 9, 0)
    assert _coalesce(lone, _queue()) is lone
    start = PullStart("r", (1, 2), 0, 9)
    q = _queue(StepOutput("r", [1], None, 9, 0))
    assert _coalesce(start, q) is start and q.qsize() == 1  # the pull start goes alone
