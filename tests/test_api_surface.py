"""The OpenAI / vLLM request parameters end to end (`nvfp4-serve up --num-prefill 0` on the CPU, the official
client): logprobs (completions with echo as lm-eval-harness's local-completions scores text, chat with
top_logprobs, streamed and not) equal to a reference forward, structured output valid for its constraint,
min_tokens, stop_reason, include_stop_str_in_output, logit_bias with penalties, continuous usage, and gRPC
max_tokens 0 meaning the rest of the context."""

from __future__ import annotations

import asyncio
import json
import re

import grpc
import pytest
import torch

from nvfp4_serve_proto import common_pb2, decode_pb2, decode_pb2_grpc
from tests.service_procs import Launched

openai = pytest.importorskip("openai")
transformers = pytest.importorskip("transformers")
CONTEXT = 64


@pytest.fixture(scope="module")
def dep(tiny_model_dir):
    d = Launched("--model", tiny_model_dir, "--num-prefill", "0", "--page-size", "4", "--kv-cache-dtype", "bf16",
                 "--context-length", str(CONTEXT))
    d.client = openai.OpenAI(base_url=f"{d.url}/v1", api_key="unused", max_retries=0)
    d.model = d.client.models.list().data[0].id
    yield d
    d.stop()


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    """log_softmax of a float32 Hugging Face forward: [positions, vocab] for a list of token ids."""
    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()

    def logprobs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0].float().log_softmax(-1)

    return logprobs


TOL = 2e-2  # the served K/V are bf16, the reference's float32


def test_lm_eval_loglikelihood_equals_the_reference_forward(dep, reference):
    # what lm-eval's local-completions sends for a loglikelihood request: token ids, echo, logprobs=1, max_tokens 1
    context, continuation = [5, 17, 99, 230, 41, 8], [77, 301, 12]
    ids = context + continuation
    for max_tokens in (1, 0):
        out = dep.client.completions.create(model=dep.model, prompt=ids, echo=True, logprobs=1, max_tokens=max_tokens,
                                            temperature=0, seed=1234)
        lp = out.choices[0].logprobs
        want = reference(ids)
        got = lp.token_logprobs[len(context):len(ids)]
        expected = [float(want[p - 1, ids[p]]) for p in range(len(context), len(ids))]
        assert got == pytest.approx(expected, abs=TOL)
        assert lp.token_logprobs[0] is None and len(lp.token_logprobs) == len(ids) + max_tokens
        for tok_lp, top in zip(lp.token_logprobs[1:], lp.top_logprobs[1:]):  # lm-eval's is_greedy reads these
            assert max(top.values()) >= tok_lp - 1e-6  # (token strings may collide: "\ufffd" keys)
        assert out.usage.completion_tokens == max_tokens and out.usage.prompt_tokens == len(ids)
        if max_tokens:  # the generated token's logprob comes from the same logits that sampled it
            assert lp.token_logprobs[-1] == pytest.approx(float(want[-1].max()), abs=TOL)
    assert sum(got) == pytest.approx(sum(expected), abs=TOL * len(got))


def test_chat_logprobs_streamed_and_not_are_the_greedy_tokens_with_their_alternatives(dep):
    msgs = [{"role": "user", "content": "Say something."}]
    r = dep.client.chat.completions.create(model=dep.model, messages=msgs, max_tokens=5, temperature=0,
                                           logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.bytes == list(entry.token.encode())
    chunks = list(dep.client.chat.completions.create(model=dep.model, messages=msgs, max_tokens=5, temperature=0,
                                                     logprobs=True, top_logprobs=3, stream=True))
    streamed = [e for ch in chunks if ch.choices and ch.choices[0].logprobs for e in ch.choices[0].logprobs.content]
    assert [(e.token, round(e.logprob, 5)) for e in streamed] == [(e.token, round(e.logprob, 5)) for e in content]


def test_completion_logprobs_stream_carries_offsets_and_continuous_usage(dep):
    chunks = list(dep.client.completions.create(
        model=dep.model, prompt="def f(x):", max_tokens=4, temperature=0, logprobs=2, stream=True,
        stream_options={"include_usage": True, "continuous_usage_stats": True}))
    texts = [ch for ch in chunks if ch.choices and ch.choices[0].logprobs]
    offsets = [o for ch in texts for o in ch.choices[0].logprobs.text_offset]
    assert len(offsets) == 4 and offsets == sorted(offsets) and offsets[0] == 0
    # every chunk carries the usage so far (tokens may arrive several to a chunk when the reader falls behind)
    assert all(ch.usage is not None for ch in chunks)
    usage = [ch.usage.completion_tokens for ch in chunks]
    assert usage == sorted(usage) and usage[-1] == 4


SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "colour": {"type": "string", "enum": ["red", "green"]}},
          "required": ["ok", "colour"], "additionalProperties": False}


def _valid(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"ok", "colour"} and isinstance(value["ok"], bool) and value["colour"] in ("red", "green")


def test_structured_output_returns_what_the_constraint_allows(dep):
    c, m = dep.client, dep.model
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": SCHEMA}}
    chat = c.chat.completions.create(model=m, messages=[{"role": "user", "content": "JSON?"}], max_tokens=40,
                                     temperature=0, response_format=fmt)
    assert chat.choices[0].finish_reason == "stop" and _valid(chat.choices[0].message.content)
    for extra in ({"guided_json": SCHEMA}, {"json_schema": json.dumps(SCHEMA)}, {"response_format": fmt}):
        out = c.completions.create(model=m, prompt="x = ", max_tokens=40, temperature=0.8, seed=3, extra_body=extra)
        assert _valid(out.choices[0].text), extra
    obj = c.completions.create(model=m, prompt="x = ", max_tokens=40, temperature=0,
                               extra_body={"response_format": {"type": "json_object"}})
    if obj.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(obj.choices[0].text), dict)
    else:
        assert obj.choices[0].text.startswith("{")
    for extra, pattern in (({"regex": "[a-c]{3}-[0-9]"}, r"[a-c]{3}-[0-9]"),
                           ({"guided_regex": "(yes|no)!"}, r"(yes|no)!"),
                           ({"guided_choice": ["left", "right"]}, r"left|right"),
                           ({"ebnf": 'root ::= "ab" [0-9]'}, r"ab[0-9]"),
                           ({"guided_grammar": 'root ::= ("x" | "y") "z"'}, r"[xy]z")):
        out = c.completions.create(model=m, prompt="def f(x):", max_tokens=20, temperature=1.0, extra_body=extra)
        assert re.fullmatch(pattern, out.choices[0].text), (extra, out.choices[0].text)
        assert out.choices[0].finish_reason == "stop"


@pytest.mark.parametrize("extra, fragment", [({"regex": "[a-"}, "regex constraint does not compile"),
                                             ({"ebnf": "root ::= "}, "ebnf constraint does not compile"),
                                             ({"guided_json": "{not json"}, "json_schema constraint")])
def test_a_constraint_that_does_not_compile_is_a_400(dep, extra, fragment):
    with pytest.raises(openai.BadRequestError, match=fragment):
        dep.client.completions.create(model=dep.model, prompt="x", max_tokens=3, extra_body=extra)


def _greedy(dep, prompt: str, n: int, **extra):
    return dep.client.completions.create(model=dep.model, prompt=prompt, max_tokens=n, temperature=0,
                                         extra_body={"ignore_eos": True, "return_token_ids": True, **extra}).choices[0]


def test_stop_strings_stop_reason_include_stop_str_and_min_tokens(dep):
    base = _greedy(dep, "def f(x):", 10)
    text = base.text
    assert len(text) >= 6
    stop = text[3:5]
    cut = text.index(stop)
    plain = _greedy(dep, "def f(x):", 10, stop=[stop])
    assert (plain.text, plain.finish_reason, plain.stop_reason) == (text[:cut], "stop", stop)
    kept = _greedy(dep, "def f(x):", 10, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == text[:cut] + stop and kept.stop_reason == stop
    # a stop token id: stop_reason names it; min_tokens bans it (and EOS) until that many tokens came out
    second = base.token_ids[1]
    by_id = _greedy(dep, "def f(x):", 10, stop_token_ids=[second])
    assert by_id.token_ids == base.token_ids[:2] and by_id.stop_reason == second
    held = _greedy(dep, "def f(x):", 10, stop_token_ids=[second], min_tokens=6)
    assert len(held.token_ids) >= 6 and second not in held.token_ids[:6]
    late = _greedy(dep, "def f(x):", 10, stop=[stop], min_tokens=8)  # stop strings count from min_tokens on
    assert len(late.token_ids) >= 8


def test_logit_bias_and_penalties_travel_to_the_sampler(dep):
    forced = _greedy(dep, "def f(x):", 6, logit_bias={"300": 100})
    assert forced.token_ids == [300] * 6
    nudged = _greedy(dep, "def f(x):", 6, logit_bias={"300": 3.0})
    assert nudged.token_ids == [300] * 6
    penalised = _greedy(dep, "def f(x):", 6, logit_bias={"300": 3.0}, frequency_penalty=2.0)
    assert 1 <= penalised.token_ids.count(300) <= 2
    once = _greedy(dep, "def f(x):", 6, logit_bias={"300": 3.0}, presence_penalty=2.0, repetition_penalty=2.0)
    assert once.token_ids.count(300) == 1
    assert _greedy(dep, "def f(x):", 3, skip_special_tokens=False).finish_reason == "length"


def test_grpc_max_tokens_zero_is_the_rest_of_the_context(dep):
    async def run() -> tuple[int, int]:
        async with grpc.aio.insecure_channel(dep.address("decode-0")) as ch:
            stub = decode_pb2_grpc.DecodeStub(ch)
            req = decode_pb2.GenerateRequest(request_id="zero", token_ids=[5, 6, 7, 8],
                                             sampling=common_pb2.SamplingParams(max_tokens=0, ignore_eos=True))
            last = None
            async for msg in stub.Generate(req):
                last = msg
            return last.completion_tokens, last.finish_reason

    assert asyncio.run(run()) == (CONTEXT - 4, decode_pb2.FINISH_REASON_LENGTH)
