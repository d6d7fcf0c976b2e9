"""Sampling on synthetic logits: every filter, penalty and the seed, checked against hand-computed values."""

from __future__ import annotations

import numpy as np
import pytest

from runtime.engine.request import SamplingParams
from runtime.engine.sampling import SequenceSampler, sample

VOCAB = 64
PROBS = np.array([0.5, 0.3, 0.15, 0.05])  # tokens 0..3; the rest get (almost) nothing


def logits_for(probs: np.ndarray = PROBS) -> np.ndarray:
    row = np.full(VOCAB, -1e4, dtype=np.float32)
    row[: probs.size] = np.log(probs)
    return row


def draw(params: SamplingParams, count: int, row: np.ndarray | None = None) -> np.ndarray:
    sampler = SequenceSampler(params, prompt_token_ids=[])
    base = logits_for() if row is None else row
    return np.array([sample(base[None].copy(), [sampler])[0].token_id for _ in range(count)])


def frequencies(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=VOCAB)[:4] / tokens.size


def test_greedy_takes_the_argmax() -> None:
    logits = np.stack([logits_for(), logits_for(PROBS[::-1].copy())])
    samplers = [SequenceSampler(SamplingParams(temperature=0), []) for _ in range(2)]
    assert [c.token_id for c in sample(logits, samplers)] == [0, 3]


def test_plain_sampling_follows_the_softmax() -> None:
    freq = frequencies(draw(SamplingParams(temperature=1.0, seed=1), 4000))
    np.testing.assert_allclose(freq, PROBS, atol=0.03)


def test_temperature_sharpens() -> None:
    freq = frequencies(draw(SamplingParams(temperature=0.5, seed=2), 4000))
    expected = PROBS**2 / (PROBS**2).sum()
    np.testing.assert_allclose(freq, expected, atol=0.03)


def test_top_k_keeps_only_the_k_best() -> None:
    tokens = draw(SamplingParams(top_k=2, seed=3), 3000)
    assert set(tokens) == {0, 1}
    np.testing.assert_allclose(frequencies(tokens)[:2], [0.625, 0.375], atol=0.03)


@pytest.mark.parametrize(("top_p", "allowed"), [(0.4, {0}), (0.7, {0, 1}), (0.9, {0, 1, 2}), (0.99, {0, 1, 2, 3})])
def test_top_p_keeps_the_smallest_nucleus(top_p: float, allowed: set[int]) -> None:
    assert set(draw(SamplingParams(top_p=top_p, seed=4), 2000)) == allowed


@pytest.mark.parametrize(("min_p", "allowed"), [(0.05, {0, 1, 2, 3}), (0.2, {0, 1, 2}), (0.5, {0, 1}), (0.9, {0})])
def test_min_p_drops_tokens_below_a_fraction_of_the_best(min_p: float, allowed: set[int]) -> None:
    assert set(draw(SamplingParams(min_p=min_p, seed=5), 2000)) == allowed


def test_same_seed_same_tokens_other_seed_other_tokens() -> None:
    a = draw(SamplingParams(seed=11), 50)
    b = draw(SamplingParams(seed=11), 50)
    c = draw(SamplingParams(seed=12), 50)
    assert a.tolist() == b.tolist()
    assert a.tolist() != c.tolist()


def test_repetition_penalty_is_hf_multiplicative() -> None:
    logits = np.array([[2.0, 1.5, -1.0, -3.0]], dtype=np.float32)
    sampler = SequenceSampler(SamplingParams(temperature=0, repetition_penalty=2.0), prompt_token_ids=[0, 2])
    sampler.output_token_ids.extend([2])
    assert sample(logits, [sampler])[0].token_id == 1  # 2.0 / 2 = 1.0 < 1.5
    np.testing.assert_allclose(logits[0], [1.0, 1.5, -2.0, -3.0])


def test_presence_and_frequency_penalties_count_output_tokens() -> None:
    logits = np.zeros((2, 6), dtype=np.float32)
    penalized = SequenceSampler(SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.25), [4, 4])
    penalized.output_token_ids.extend([1, 1, 1, 3])
    untouched = SequenceSampler(SamplingParams(temperature=0), [])
    sample(logits, [penalized, untouched])
    np.testing.assert_allclose(logits[0], [0, -1.25, 0, -0.75, 0, 0])  # the prompt's 4s are not penalized
    np.testing.assert_allclose(logits[1], 0)


def test_logit_bias_applies_per_row() -> None:
    logits = np.stack([logits_for(), logits_for()])
    biased = SequenceSampler(SamplingParams(temperature=0, logit_bias={3: 5.0, 0: -100.0}), [])
    plain = SequenceSampler(SamplingParams(temperature=0), [])
    assert [c.token_id for c in sample(logits, [biased, plain])] == [3, 0]


def test_logprobs_are_raw_log_softmax_and_top_is_sorted() -> None:
    raw = np.array([3.0, 1.0, 0.5, -2.0, 2.5], dtype=np.float32)
    expected = raw - np.log(np.exp(raw).sum())
    params = SamplingParams(temperature=0.3, logprobs=True, top_logprobs=3, repetition_penalty=1.3, seed=0)
    choice = sample(raw[None].copy(), [SequenceSampler(params, [0])])[0]
    assert choice.logprob == pytest.approx(expected[choice.token_id], abs=1e-5)
    assert [t for t, _ in choice.top] == [0, 4, 1]
    np.testing.assert_allclose([v for _, v in choice.top], expected[[0, 4, 1]], atol=1e-5)
    assert np.exp(expected).sum() == pytest.approx(1.0)


def test_sampling_rows_do_not_leak_into_each_other() -> None:
    logits = np.stack([logits_for()] * 3)
    samplers = [
        SequenceSampler(SamplingParams(top_k=1, seed=0), []),
        SequenceSampler(SamplingParams(temperature=0, logit_bias={2: 50.0}), []),
        SequenceSampler(SamplingParams(temperature=0), []),
    ]
    assert [c.token_id for c in sample(logits, samplers)] == [0, 2, 0]


def test_flat_distribution_over_a_large_vocabulary() -> None:
    row = np.random.default_rng(0).normal(size=49152).astype(np.float32) * 0.1
    sampler = SequenceSampler(SamplingParams(temperature=2.0, top_p=0.5, seed=9), [])
    tokens = {sample(row[None].copy(), [sampler])[0].token_id for _ in range(200)}
    assert len(tokens) > 150  # half of a nearly flat distribution is ~24k tokens
