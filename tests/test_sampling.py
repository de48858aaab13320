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
