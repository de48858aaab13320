"""SamplingParams validation and batched sampling semantics."""

from __future__ import annotations

import pytest
import torch

from engine.sampling import SamplingParams, make_generator, sample

GREEDY = SamplingParams(temperature=0.0)


def _logits(batch: int, vocab: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(batch, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def _draw(logits: torch.Tensor, params: SamplingParams, n: int, seed: int | None = None) -> torch.Tensor:
    """n independent draws from one row (the row repeated n times, default generator unless seeded)."""
    rows = logits.expand(n, -1).contiguous()
    gens = [make_generator(seed, "cpu")] * n if seed is not None else [None] * n
    return sample(rows, [params] * n, gens)


def test_greedy_is_argmax():
    logits = _logits(8, 100)
    out = sample(logits, [GREEDY] * 8, [None] * 8)
    assert out.dtype == torch.int64 and torch.equal(out, logits.argmax(-1))
    assert GREEDY.greedy and not SamplingParams().greedy


def test_top_k_one_equals_greedy_even_when_seeded():
    logits = _logits(8, 100, seed=1)
    params = [SamplingParams(temperature=1.5, top_k=1, seed=i) for i in range(8)]
    out = sample(logits, params, [make_generator(p.seed, "cpu") for p in params])
    assert torch.equal(out, logits.argmax(-1))


def test_mixed_batch_keeps_greedy_rows_exact():
    logits = _logits(6, 50, seed=2)
    params = [GREEDY, SamplingParams(), GREEDY, SamplingParams(top_p=0.5), GREEDY, SamplingParams(min_p=0.2)]
    out = sample(logits, params, [None] * 6)
    assert torch.equal(out[0::2], logits[0::2].argmax(-1))


def test_seeded_generators_are_deterministic_and_seeds_differ():
    logits = torch.zeros(1, 1000)  # uniform: every draw is pure randomness

    def run(seed: int) -> list[int]:
        gen = make_generator(seed, "cpu")
        return [int(sample(logits, [SamplingParams(seed=seed)], [gen])) for _ in range(20)]

    assert run(7) == run(7)
    assert run(7) != run(8)
    assert len(set(run(7))) > 10
    assert make_generator(None, "cpu") is None


def test_seeded_row_is_unaffected_by_its_batch_neighbours():
    logits = _logits(3, 200, seed=3)
    p = SamplingParams(seed=5)
    alone = sample(logits[1:2], [p], [make_generator(5, "cpu")])
    batched = sample(logits, [SamplingParams(), p, GREEDY], [None, make_generator(5, "cpu"), None])
    assert batched[1] == alone[0]


def test_plain_sampling_follows_the_softmax():
    torch.manual_seed(0)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    counts = torch.bincount(_draw(logits, SamplingParams(), 8000), minlength=4).float() / 8000
    torch.testing.assert_close(counts, logits.softmax(-1)[0], atol=0.025, rtol=0)
    hot = torch.bincount(_draw(logits, SamplingParams(temperature=2.0), 8000), minlength=4).float() / 8000
    torch.testing.assert_close(hot, (logits / 2).softmax(-1)[0], atol=0.025, rtol=0)


def test_top_p_keeps_the_smallest_prefix_reaching_the_mass():
    torch.manual_seed(1)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    draws = _draw(probs.log().unsqueeze(0), SamplingParams(top_p=0.7), 8000)
    counts = torch.bincount(draws, minlength=4).float() / 8000
    assert counts[2] == 0 and counts[3] == 0  # 0.5 + 0.3 >= 0.7: tokens 2, 3 are cut
    torch.testing.assert_close(counts[:2], torch.tensor([0.5, 0.3]) / 0.8, atol=0.03, rtol=0)
    assert set(_draw(probs.log().unsqueeze(0), SamplingParams(top_p=0.4), 200).tolist()) == {0}


def test_top_k_and_min_p_restrict_the_support():
    torch.manual_seed(2)
    logits = torch.tensor([[3.0, 2.9, 2.8, 0.0, -1.0, -2.0]])
    assert set(_draw(logits, SamplingParams(top_k=2), 500).tolist()) == {0, 1}
    probs = logits.softmax(-1)[0]
    allowed = {i for i, p in enumerate(probs.tolist()) if p >= 0.5 * probs.max()}
    assert set(_draw(logits, SamplingParams(min_p=0.5), 500).tolist()) == allowed == {0, 1, 2}


@pytest.mark.parametrize("kwargs,match", [
    ({"temperature": -0.1}, "temperature must be in"), ({"temperature": 2.5}, "temperature must be in"),
    ({"top_p": 0.0}, r"top_p must be in \(0, 1\]"), ({"top_p": 1.1}, "top_p"), ({"min_p": 1.5}, "min_p"),
    ({"max_tokens": 0}, "max_tokens must be an integer >= 1"), ({"seed": -1}, "seed must be"),
    ({"temperature": float("nan")}, "finite"), ({"stop_token_ids": (1, -2)}, "stop_token_ids"),
])
def test_invalid_params_are_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_params_normalise_and_type_check():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    with pytest.raises(TypeError, match="top_k must be an integer"):
        SamplingParams(top_k=2.5)
    with pytest.raises(ValueError, match="B == len"):
        sample(torch.zeros(2, 5), [GREEDY], [None])


# -- controls: penalties, logit_bias, min_tokens, masks (batched) against a per-row PyTorch reference ---------


def _reference_controls(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int],
                        banned: set[int], mask: torch.Tensor | None) -> torch.Tensor:
    """One row, written for clarity: mask, bias, min_tokens ban, repetition, then frequency/presence."""
    row = logits.clone()
    if mask is not None:
        row[~mask] = float("-inf")
    for t, b in p.logit_bias:
        row[t] += b
    if len(output) < p.min_tokens:
        for t in banned:
            row[t] = float("-inf")
    for t in set(prompt) | set(output):
        row[t] = row[t] / p.repetition_penalty if row[t] > 0 else row[t] * p.repetition_penalty
    for t in set(output):
        row[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return row


def test_apply_controls_equals_the_per_row_reference_in_one_mixed_batch():
    from engine.sampling import RowTokens, apply_controls

    vocab = 64
    logits = _logits(5, vocab, seed=11)
    params = [SamplingParams(),  # untouched row
              SamplingParams(repetition_penalty=1.7),
              SamplingParams(presence_penalty=0.8, frequency_penalty=-0.3),
              SamplingParams(logit_bias=((3, 10.0), (9, -100.0)), min_tokens=4, max_tokens=8),
              SamplingParams(repetition_penalty=0.6, frequency_penalty=1.5, logit_bias=((1, 2.0),))]
    prompts = [[1, 2], [4, 5, 4, 60], [7], [2, 3], [1, 8, 8]]
    outputs = [[3], [5, 6, 6], [7, 7, 7, 10], [11, 12], [8, 40, 40]]
    banned = [set(), set(), set(), {0, 13}, set()]
    masks = torch.ones(5, vocab, dtype=torch.bool)
    masks[2, 30:] = False
    rows = [RowTokens(p, o, frozenset(b)) for p, o, b in zip(prompts, outputs, banned)]
    got = apply_controls(logits, params, rows, masks)
    for i in range(5):
        want = _reference_controls(logits[i], params[i], prompts[i], outputs[i], banned[i], masks[i])
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-6)
    # no control anywhere: the logits come back as they are (no copy)
    plain = [RowTokens([1], [2]) for _ in range(5)]
    assert apply_controls(logits, [SamplingParams()] * 5, plain) is logits


def test_penalties_change_what_greedy_picks():
    from engine.sampling import RowTokens, apply_controls

    logits = torch.tensor([[5.0, 4.9, 0.0]])
    p = SamplingParams(temperature=0.0, frequency_penalty=1.0)
    out = apply_controls(logits, [p], [RowTokens([], [0])])
    assert int(sample(out, [p], [None])) == 1  # token 0 was generated once: 5 - 1 < 4.9
    assert int(sample(logits, [p], [None])) == 0


@pytest.mark.parametrize("kwargs, fragment", [
    ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
    ({"frequency_penalty": -3.0}, "frequency_penalty"),
    ({"repetition_penalty": 0.0}, "repetition_penalty must be in (0, 2]"),
    ({"logit_bias": ((5, 101.0),)}, "logit_bias"),
    ({"min_tokens": 17}, "min_tokens must be an integer in [0, max_tokens=16]"),
    ({"logprobs": 21}, "logprobs must be an integer in [0, 20]"),
    ({"prompt_logprobs": -1}, "prompt_logprobs"),
])
def test_control_parameters_are_validated(kwargs, fragment):
    with pytest.raises(ValueError, match=fragment.replace("[", r"\[").replace("(", r"\(")):
        SamplingParams(**kwargs)


def test_logprobs_are_the_raw_log_softmax_with_top_alternatives():
    from engine.logprobs import gather_logprobs

    logits = _logits(3, 40, seed=4)
    ids = torch.tensor([5, 0, 39])
    got = gather_logprobs(logits, ids, [2, 0, 3]).to_host(ids.tolist())
    ref = logits.log_softmax(-1)
    for i, lp in enumerate(got):
        assert lp.token_id == ids[i] and abs(lp.logprob - float(ref[i, ids[i]])) < 1e-6
        order = ref[i].argsort(descending=True).tolist()
        assert [t for t, _ in lp.top] == order[:[2, 0, 3][i]]
