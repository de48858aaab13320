"""One generation request as the scheduler tracks it.

Token regions of a request (``kv_len`` tokens have K/V in the pool):

    tokens = prompt_ids + output_ids
    [ cached prefix | computed by extend ...... | not yet in the pool ]
    0          num_cached_tokens            kv_len               len(tokens)

While decoding, exactly one token (the last sampled) is not yet in the pool: the next decode
step writes its K/V and samples the token after it. With a decode step in flight (overlap scheduling,
``engine.in_flight``) ``kv_len`` already counts the slot that step writes, and the token it samples is not in
``output_ids`` until the step is read: ``kv_len == len(tokens)`` then.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.fence import Fence
from engine.logprobs import TokenLogprob
from engine.outcome import Failure, FinishReason
from engine.sampling import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"  # queued, holds no pages
    EXTENDING = "extending"  # holds pages, prompt being computed locally in chunks
    PULLING = "pulling"  # holds pages, prompt pages arriving from a prefill service
    RUNNING = "running"  # decoding
    FINISHED = "finished"


@dataclass
class Request:
    rid: str
    prompt_ids: list[int]
    sampling: SamplingParams
    # Only compute K/V and the first token (a prefill service's job); never decode.
    prefill_only: bool = False
    # Pull the prompt's pages from elsewhere instead of computing them (decode service).
    remote_prefill: bool = False
    output_ids: list[int] = field(default_factory=list)
    page_ids: list[int] = field(default_factory=list)  # the request holds one ref on each
    kv_len: int = 0
    num_cached_tokens: int = 0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    generator: torch.Generator | None = None
    num_retractions: int = 0
    grammar: Any = None  # engine.grammar.Matcher of a structured-output request
    # with sampling.logprobs: one per output id; with sampling.prompt_logprobs: one per prompt id from the second
    output_logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.output_ids

    def token_at(self, pos: int) -> int:
        """``tokens[pos]`` without building the concatenated list (hot in every decode step)."""
        n = len(self.prompt_ids)
        return self.prompt_ids[pos] if pos < n else self.output_ids[pos - n]

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    @property
    def extend_target_len(self) -> int:
        """Tokens whose K/V the extend phase must compute (all but the last sampled token)."""
        return self.num_tokens if not self.output_ids else self.num_tokens - 1

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def stop_reason(self, eos_token_ids: frozenset[int], max_context_len: int) -> FinishReason | None:
        """Why the request ends with its last output token (a stop token first, then length), or None."""
        tok, sp = self.output_ids[-1], self.sampling
        if (not sp.ignore_eos and tok in eos_token_ids) or tok in sp.stop_token_ids:
            return FinishReason.STOP
        if len(self.output_ids) >= sp.max_tokens or self.num_tokens >= max_context_len:
            return FinishReason.LENGTH
        return None

    def step_output(self, tokens: list[int]) -> StepOutput:
        """What a step hands the caller for this request's newest ``tokens`` (its logprobs, and the prompt's with
        its first token, when asked for)."""
        sp, lps = self.sampling, self.output_logprobs
        logprobs = lps[-len(tokens):] if sp.logprobs is not None and len(lps) == len(self.output_ids) else None
        first = len(self.output_ids) == len(tokens)
        prompt_lps = self.prompt_logprobs if sp.prompt_logprobs is not None and first else None
        return StepOutput(self.rid, tokens, self.finish_reason, self.prompt_len, self.num_cached_tokens,
                          logprobs=logprobs, prompt_logprobs=prompt_lps)


@dataclass
class StepOutput:
    """What one scheduler step produced for one request (streamed to its caller)."""

    rid: str
    new_token_ids: list[int]
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_cached_tokens: int
    failure: Failure | None = None  # set on a request that failed (its finish_reason is ABORT)
    logprobs: list[TokenLogprob] | None = None  # one per new token, when the request asked for them
    prompt_logprobs: list[TokenLogprob] | None = None  # with the request's first token, when asked for


@dataclass(frozen=True)
class PrefillProgress:
    """A prefill-only request's prompt K/V is in the pool, every layer, for tokens [0, kv_len): pages
    [0, kv_len // page_size) are final and may be sent. ``fence`` completes once the device wrote them."""

    rid: str
    kv_len: int
    fence: Fence


@dataclass(frozen=True)
class PullStart:
    """A remote-prefill request was admitted: its pages are allocated; fill tokens [prefix_len, prompt_len)."""

    rid: str
    page_ids: tuple[int, ...]
    prefix_len: int
    num_tokens: int
