"""Protobuf <-> engine conversions shared by the services."""

from __future__ import annotations

from engine.sampling import SamplingParams
from nvfp4_serve_proto import common_pb2
from svc_common.errors import InvalidRequest


def sampling_from_proto(sp: common_pb2.SamplingParams, unset_max_tokens: int) -> SamplingParams:
    """Proto3 zero values mean "unset" (common.proto): temperature 0 is greedy, top_p 0 is 1.0,
    repetition_penalty 0 is 1.0, max_tokens 0 is ``unset_max_tokens`` (the decode service passes the rest of
    the context). A max_tokens below 0 is INVALID_ARGUMENT."""
    if sp.max_tokens < 0:
        raise InvalidRequest(f"invalid sampling parameters: max_tokens must be >= 0 (0: the rest of the context), "
                             f"got {sp.max_tokens}")
    max_tokens = sp.max_tokens or unset_max_tokens
    try:
        return SamplingParams(
            temperature=sp.temperature, top_p=sp.top_p or 1.0, top_k=sp.top_k, min_p=sp.min_p,
            seed=sp.seed if sp.HasField("seed") else None, max_tokens=max_tokens,
            stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos,
            presence_penalty=sp.presence_penalty, frequency_penalty=sp.frequency_penalty,
            repetition_penalty=sp.repetition_penalty or 1.0, logit_bias=tuple(sorted(sp.logit_bias.items())),
            min_tokens=min(sp.min_tokens, max_tokens) if sp.min_tokens >= 0 else sp.min_tokens,
            logprobs=sp.logprobs if sp.HasField("logprobs") else None,
            prompt_logprobs=sp.prompt_logprobs if sp.HasField("prompt_logprobs") else None)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"invalid sampling parameters: {e}") from e


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
                                    max_tokens=sp.max_tokens, stop_token_ids=list(sp.stop_token_ids),
                                    ignore_eos=sp.ignore_eos, presence_penalty=sp.presence_penalty,
                                    frequency_penalty=sp.frequency_penalty,
                                    repetition_penalty=sp.repetition_penalty, logit_bias=dict(sp.logit_bias),
                                    min_tokens=sp.min_tokens)
    if sp.seed is not None:
        msg.seed = sp.seed
    if sp.logprobs is not None:
        msg.logprobs = sp.logprobs
    if sp.prompt_logprobs is not None:
        msg.prompt_logprobs = sp.prompt_logprobs
    return msg


def logprobs_to_proto(lps) -> list[common_pb2.TokenLogprob]:
    """engine.logprobs.TokenLogprob records as protos."""
    return [common_pb2.TokenLogprob(token_id=lp.token_id, logprob=lp.logprob, top_ids=[t for t, _ in lp.top],
                                    top_logprobs=[v for _, v in lp.top]) for lp in lps]


def check_token_ids(ids, vocab_size: int, what: str = "token_ids") -> list[int]:
    ids = list(ids)
    if not ids:
        raise InvalidRequest(f"{what} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{what} has {len(bad)} ids outside the vocabulary [0, {vocab_size}), e.g. {bad[0]}")
    return ids
