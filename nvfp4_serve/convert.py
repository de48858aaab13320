"""Protobuf <-> engine conversions shared by the services."""

from __future__ import annotations

from engine.sampling import SamplingParams
from nvfp4_serve.errors import InvalidRequest
from nvfp4_serve_proto import common_pb2


def sampling_from_proto(sp: common_pb2.SamplingParams, default_max_tokens: int = 16) -> SamplingParams:
    """Proto3 zero values mean "unset": temperature 0 is greedy, top_p 0 is 1.0, max_tokens 0 the default."""
    try:
        return SamplingParams(
            temperature=sp.temperature, top_p=sp.top_p or 1.0, top_k=sp.top_k, min_p=sp.min_p,
            seed=sp.seed if sp.HasField("seed") else None, max_tokens=sp.max_tokens or default_max_tokens,
            stop_token_ids=tuple(sp.stop_token_ids), ignore_eos=sp.ignore_eos)
    except (ValueError, TypeError) as e:
        raise InvalidRequest(f"invalid sampling parameters: {e}") from e


def sampling_to_proto(sp: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(temperature=sp.temperature, top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
                                    max_tokens=sp.max_tokens, stop_token_ids=list(sp.stop_token_ids),
                                    ignore_eos=sp.ignore_eos)
    if sp.seed is not None:
        msg.seed = sp.seed
    return msg


def check_token_ids(ids, vocab_size: int, what: str = "token_ids") -> list[int]:
    ids = list(ids)
    if not ids:
        raise InvalidRequest(f"{what} is empty")
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"{what} has {len(bad)} ids outside the vocabulary [0, {vocab_size}), e.g. {bad[0]}")
    return ids
