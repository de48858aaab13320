"""Router units: prefix tree, routing policy, stop strings, admission gate, config, gRPC error mapping."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from router.admission import AdmissionGate
from router.config import API_KEY_ENV, RouterConfig, build_arg_parser, config_from_args, model_limits
from router.generation import map_grpc_error
from router.openai_protocol import OpenAIError
from router.policy import CacheAwarePolicy, DecodeCandidate, PolicyConfig, PrefillCandidate, choose_prefill
from router.prefix_tree import PrefixTree, _common_prefix_len
from router.stop_strings import StopStringMatcher
from svc_common.service_auth import SERVICE_TOKEN_ENV

# ------------------------------------------------------------------------------------------- prefix tree


def test_prefix_tree_matches_longest_prefix_across_split_edges():
    t = PrefixTree(max_tokens=1000)
    t.insert([1, 2, 3, 4, 5])
    t.insert([1, 2, 3, 9])
    assert t.match_len([1, 2, 3, 4, 5, 6]) == 5
    assert t.match_len([1, 2, 3, 9, 9]) == 4
    assert t.match_len([1, 2, 7]) == 2
    assert t.match_len([2, 1]) == 0
    assert t.match_len([]) == 0
    # [1 2 3] + [4 5] + [9]: the split keeps every token exactly once
    assert t.num_tokens == 6
    assert t.num_nodes == 3


def test_prefix_tree_insert_of_existing_prefix_adds_nothing():
    t = PrefixTree(max_tokens=1000)
    t.insert(range(10))
    t.insert(range(4))  # ends inside an edge: split, no new tokens
    assert t.num_tokens == 10
    assert t.num_nodes == 2
    assert t.match_len(list(range(4))) == 4


def test_prefix_tree_evicts_least_recently_used_leaf_first():
    t = PrefixTree(max_tokens=10)
    t.insert([1, 1, 1, 1])  # A (clock 1)
    t.insert([2, 2, 2, 2])  # B (clock 2)
    t.insert([1, 1, 1, 1])  # touch A (clock 3): B is now the oldest
    t.insert([3, 3, 3, 3])  # 12 tokens > 10: evict B
    assert t.match_len([2, 2, 2, 2]) == 0
    assert t.match_len([1, 1, 1, 1]) == 4
    assert t.match_len([3, 3, 3, 3]) == 4
    assert t.num_tokens == 8


def test_prefix_tree_eviction_climbs_to_parent_that_became_a_leaf():
    t = PrefixTree(max_tokens=8)
    t.insert([5, 5, 5, 6])  # clock 1
    t.insert([5, 5, 5, 7])  # clock 2: [5 5 5] -> {[6], [7]}
    t.insert([9, 9, 9, 9])  # clock 3: 9 tokens > 8 -> evict leaf [6] (oldest)
    assert t.num_tokens == 8
    assert t.match_len([5, 5, 5, 6]) == 3
    assert t.match_len([5, 5, 5, 7]) == 4
    t.set_max_tokens(4)  # now [7] (clock 2), then [5 5 5] (clock 2, a leaf now) go before [9 9 9 9]
    assert t.num_tokens == 4
    assert t.match_len([5, 5, 5, 7]) == 0
    assert t.match_len([9, 9, 9, 9]) == 4


def test_prefix_tree_truncates_a_prompt_longer_than_its_budget():
    t = PrefixTree(max_tokens=5)
    t.insert(range(100))
    assert t.num_tokens == 5
    assert t.match_len(list(range(100))) == 5


def test_prefix_tree_clear_and_validation():
    t = PrefixTree(max_tokens=5)
    t.insert([1, 2])
    t.clear()
    assert (t.num_tokens, t.num_nodes, t.match_len([1, 2])) == (0, 0, 0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        PrefixTree(0)


def test_prefix_tree_agrees_with_brute_force_on_random_prompts():
    rng = random.Random(0)
    t = PrefixTree(max_tokens=10**9)
    inserted: list[list[int]] = []
    for _ in range(200):
        base = rng.choice(inserted)[: rng.randrange(0, 40)] if inserted and rng.random() < 0.7 else []
        seq = base + [rng.randrange(4) for _ in range(rng.randrange(1, 30))]
        t.insert(seq)
        inserted.append(seq)
        probe = rng.choice(inserted)[: rng.randrange(0, 60)] + [rng.randrange(4) for _ in range(rng.randrange(3))]
        expected = max(_common_prefix_len(s, probe) for s in inserted)
        assert t.match_len(probe) == expected


def test_common_prefix_len_finds_the_mismatch_inside_long_sequences():
    a = tuple(range(1000))
    for cut in (0, 1, 63, 64, 65, 500, 999):
        b = a[:cut] + (-1,) + a[cut + 1:]
        assert _common_prefix_len(a, b) == cut
    assert _common_prefix_len(a, a[:300]) == 300


# ----------------------------------------------------------------------------------------------- policy


def _policy(**kw) -> CacheAwarePolicy:
    return CacheAwarePolicy(PolicyConfig(**{"cache_threshold": 0.5, "balance_abs_threshold": 4,
                                            "balance_rel_threshold": 1.5, **kw}))


def test_decode_choice_follows_the_cached_prefix():
    p = _policy()
    p.record("b:2", list(range(100)))
    choice = p.choose_decode(list(range(120)), [DecodeCandidate("a:1", 0), DecodeCandidate("b:2", 3)])
    assert choice == ("b:2", 100, "cache_hit")


def test_decode_choice_below_threshold_goes_to_least_loaded():
    p = _policy()
    p.record("b:2", list(range(40)))  # 40 / 100 < 0.5
    choice = p.choose_decode(list(range(100)), [DecodeCandidate("a:1", 1), DecodeCandidate("b:2", 0)])
    assert choice.address == "b:2" and choice.reason == "least_loaded"
    choice = p.choose_decode(list(range(100)), [DecodeCandidate("a:1", 0), DecodeCandidate("b:2", 1)])
    assert choice == ("a:1", 0, "least_loaded")


def test_decode_choice_yields_to_balance_only_when_both_thresholds_are_exceeded():
    p = _policy()
    p.record("b:2", list(range(100)))
    prompt = list(range(100))
    # gap 5 > 4 and 10 > 1.5 * 5: both exceeded -> least loaded
    assert p.choose_decode(prompt, [DecodeCandidate("a:1", 5), DecodeCandidate("b:2", 10)]).reason == "balance"
    # gap 4 is not > 4 -> stay with the cache
    assert p.choose_decode(prompt, [DecodeCandidate("a:1", 6), DecodeCandidate("b:2", 10)]).reason == "cache_hit"
    # gap 20 > 4 but 60 <= 1.5 * 40 -> stay with the cache
    assert p.choose_decode(prompt, [DecodeCandidate("a:1", 40), DecodeCandidate("b:2", 60)]).reason == "cache_hit"


def test_decode_ties_go_to_the_smaller_tree_then_listed_order():
    p = _policy()
    p.record("a:1", [7, 7, 7])
    cands = [DecodeCandidate("a:1", 0), DecodeCandidate("b:2", 0), DecodeCandidate("c:3", 0)]
    assert p.choose_decode([1, 2, 3], cands).address == "b:2"
    p.record("b:2", [8])
    assert p.choose_decode([1, 2, 3], cands).address == "c:3"


def test_decode_choice_spreads_then_sticks_for_a_two_turn_chat():
    p = _policy()
    cands = [DecodeCandidate("a:1", 0), DecodeCandidate("b:2", 0)]
    turn1 = list(range(50))
    first = p.choose_decode(turn1, cands)
    p.record(first.address, turn1 + [900, 901])  # prompt + the answer the worker cached
    other = p.choose_decode([5000 + i for i in range(50)], cands)
    assert other.address != first.address  # a new conversation goes to the emptier worker
    turn2 = turn1 + [900, 901] + list(range(200, 230))
    again = p.choose_decode(turn2, cands)
    assert again == (first.address, 52, "cache_hit")


def test_tree_budget_is_capped_by_the_worker_pool():
    p = _policy(tree_max_tokens=1000)
    p.set_tree_budget("a:1", 64)
    assert p.tree("a:1").max_tokens == 64
    p.set_tree_budget("a:1", 10**9)
    assert p.tree("a:1").max_tokens == 1000
    p.record("a:1", range(10))
    p.forget("a:1")
    assert p.tree_sizes() == {"a:1": 0}


def test_prefill_choice_is_least_outstanding_then_least_routed():
    cands = [PrefillCandidate("p:1", 100, 0), PrefillCandidate("p:2", 50, 9), PrefillCandidate("p:3", 50, 3)]
    assert choose_prefill(cands) == "p:3"
    assert choose_prefill([PrefillCandidate("p:1", 0, 1), PrefillCandidate("p:2", 0, 1)]) == "p:1"
    with pytest.raises(ValueError):
        choose_prefill([])


def test_policy_config_validation_says_which_flag():
    with pytest.raises(ValueError, match="--cache-threshold"):
        PolicyConfig(cache_threshold=1.5)
    with pytest.raises(ValueError, match="--balance-rel-threshold"):
        PolicyConfig(balance_rel_threshold=0.5)


# ------------------------------------------------------------------------------------------ stop strings


def _run_matcher(stops: list[str], deltas: list[str]) -> tuple[str, bool]:
    m = StopStringMatcher(stops)
    out = []
    for d in deltas:
        r = m.push(d)
        out.append(r.text)
        if r.stopped:
            return "".join(out), True
    return "".join(out) + m.flush(), False


def test_stop_string_split_over_deltas_is_cut_and_never_emitted():
    m = StopStringMatcher(["</end>"])
    assert m.push("Hello </") == ("Hello ", False)
    assert m.held_back == "</"
    assert m.push("en") == ("", False)
    assert m.push("d> ignored") == ("", True)


def test_partial_stop_prefix_is_released_once_it_cannot_match():
    m = StopStringMatcher(["STOP"])
    assert m.push("ST") == ("", False)
    assert m.push("AR") == ("STAR", False)
    assert m.flush() == ""
    m = StopStringMatcher(["abc"])
    assert m.push("xab") == ("x", False)
    assert m.flush() == "ab"


def test_earliest_of_several_stop_strings_wins():
    assert _run_matcher(["world", "lo w"], ["hel", "lo wor", "ld"]) == ("hel", True)
    assert _run_matcher(["aab"], ["a", "a", "a", "b"]) == ("a", True)  # overlapping prefixes


def test_stop_matcher_agrees_with_a_full_text_search_on_random_splits():
    rng = random.Random(1)
    for _ in range(500):
        text = "".join(rng.choice("ab c") for _ in range(rng.randrange(0, 30)))
        stops = ["".join(rng.choice("ab c") for _ in range(rng.randrange(1, 4))) for _ in range(rng.randrange(1, 3))]
        cuts = sorted(rng.sample(range(len(text) + 1), k=min(len(text) + 1, rng.randrange(1, 6))))
        deltas = [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)], strict=True)]
        # spec: after each delta, cut before the earliest occurrence in the text so far (later text never
        # comes: generation stops at the delta that completed a stop string)
        expected, seen = (text, False), ""
        for d in deltas:
            seen += d
            hits = [i for i in (seen.find(s) for s in stops) if i >= 0]
            if hits:
                expected = (seen[:min(hits)], True)
                break
        assert _run_matcher(stops, deltas) == expected, (text, stops, deltas)


def test_no_stop_strings_passes_text_through():
    assert StopStringMatcher([]).push("anything") == ("anything", False)
    with pytest.raises(ValueError, match="must not be empty"):
        StopStringMatcher([""])


# -------------------------------------------------------------------------------------- admission gate


def test_admission_gate_queues_fifo_and_rejects_beyond_the_queue():
    async def scenario() -> None:
        gate = AdmissionGate(max_active=1, max_queued=2, queue_timeout_s=5, retry_after_s=3)
        await gate.acquire()
        order: list[str] = []

        async def waiter(name: str) -> None:
            await gate.acquire()
            order.append(name)

        w1 = asyncio.create_task(waiter("first"))
        await asyncio.sleep(0)
        w2 = asyncio.create_task(waiter("second"))
        await asyncio.sleep(0)
        assert (gate.num_active, gate.num_queued) == (1, 2)
        with pytest.raises(OpenAIError) as exc:
            await gate.acquire()
        assert exc.value.status == 429 and exc.value.headers == {"Retry-After": "3"}
        gate.release()  # handed to "first": the slot never becomes free in between
        await w1
        assert order == ["first"] and gate.num_active == 1
        gate.release()
        await w2
        gate.release()
        assert (gate.num_active, gate.num_queued, order) == (0, 0, ["first", "second"])

    asyncio.run(scenario())


def test_admission_gate_times_out_with_503_and_cancelled_waiters_leave_the_line():
    async def scenario() -> None:
        gate = AdmissionGate(max_active=1, max_queued=4, queue_timeout_s=0.05)
        await gate.acquire()
        with pytest.raises(OpenAIError) as exc:
            await gate.acquire()
        assert exc.value.status == 503 and "timed out" in exc.value.message
        assert gate.num_queued == 0
        task = asyncio.create_task(gate.acquire())
        await asyncio.sleep(0)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert gate.num_queued == 0
        gate.release()
        assert gate.num_active == 0
        with pytest.raises(RuntimeError, match="without a matching acquire"):
            gate.release()

    asyncio.run(scenario())


# ------------------------------------------------------------------------------------------------ config


def test_config_validation_names_the_flag():
    with pytest.raises(ValueError, match="--decode-addresses needs at least one"):
        RouterConfig(model_dir="/m")
    with pytest.raises(ValueError, match="is not host:port"):
        RouterConfig(decode_addresses=("nohost",), model_dir="/m")
    with pytest.raises(ValueError, match="--model-dir is required"):
        RouterConfig(decode_addresses=("a:1",))
    with pytest.raises(ValueError, match="--cache-threshold"):
        RouterConfig(decode_addresses=("a:1",), model_dir="/m", cache_threshold=2.0)
    with pytest.raises(ValueError, match="lists an address twice"):
        RouterConfig(decode_addresses=("a:1", "a:1"), model_dir="/m")


def test_arg_parser_defaults_come_from_the_dataclass(monkeypatch):
    monkeypatch.delenv(API_KEY_ENV, raising=False)
    monkeypatch.delenv(SERVICE_TOKEN_ENV, raising=False)
    args = build_arg_parser().parse_args(["--decode", "h:1,h:2", "h:3", "--prefill-addresses", "p:9",
                                          "--model", "/models/qwen", "--no-metrics-open"])
    cfg = config_from_args(args)
    assert cfg == RouterConfig(decode_addresses=("h:1", "h:2", "h:3"), prefill_addresses=("p:9",),
                               model_dir="/models/qwen")
    assert cfg.host == "127.0.0.1" and cfg.model_name == "qwen"
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    assert config_from_args(args).api_key == "from-env"
    assert config_from_args(args).public_dict()["api_key"] == "<set>"
    assert config_from_args(args).service_token == "from-env"  # the API key guards the gRPC links too
    monkeypatch.setenv(SERVICE_TOKEN_ENV, "internal")
    cfg = config_from_args(args)
    assert cfg.service_token == cfg.tls.service_token == "internal" and cfg.public_dict()["service_token"] == "<set>"
    assert "internal" not in repr(cfg) and "internal" not in repr(cfg.tls)


def test_model_limits_read_config_json(tmp_path):
    (tmp_path / "config.json").write_text('{"max_position_embeddings": 2048, "vocab_size": 1000}')
    cfg = RouterConfig(decode_addresses=("a:1",), model_dir=str(tmp_path))
    assert model_limits(cfg, tokenizer_vocab_size=900) == (2048, 1000)
    assert model_limits(RouterConfig(decode_addresses=("a:1",), model_dir=str(tmp_path), max_model_len=64)) == (
        64, 1000)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="--max-model-len"):
        model_limits(cfg)


# ---------------------------------------------------------------------------------------- gRPC errors


@pytest.mark.parametrize("code, details, status, kind, retryable", [
    (grpc.StatusCode.INVALID_ARGUMENT, "token id 9999 out of vocabulary", 400, "invalid_argument", False),
    (grpc.StatusCode.FAILED_PRECONDITION, "kv dtype nvfp4 != fp8_e4m3", 500, "failed_precondition", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "waiting queue full (4096)", 429, "resource_exhausted", True),
    # a prompt that can never fit is told apart by its status (the engine's NEVER_FITS), never by its text
    (grpc.StatusCode.INVALID_ARGUMENT, "prompt of 9000 tokens needs 2251 pages, the KV pool holds 32 pages", 400,
     "invalid_argument", False),
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "prompt of 9000 tokens can never fit in the pool", 429, "resource_exhausted",
     True),
    (grpc.StatusCode.UNAVAILABLE, "prefill 127.0.0.1:1 unreachable", 503, "unavailable", True),
    (grpc.StatusCode.DEADLINE_EXCEEDED, "transfer deadline", 504, "timeout", False),
    (grpc.StatusCode.INTERNAL, "boom", 502, "internal", False),
])
def test_grpc_status_maps_to_http_status(code, details, status, kind, retryable):
    exc = grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details=details)
    failed = map_grpc_error(exc, "127.0.0.1:5000")
    assert (failed.error.status, failed.kind, failed.retryable) == (status, kind, retryable)
    assert details in failed.error.message
