"""Golden and property tests for specdecode.sampling (logits -> probs, block counts, sampling)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from stat_helpers import block_output_counts

from specdecode.sampling import (
    SamplingParams,
    apply_penalties,
    draw_uniforms,
    logits_to_probs,
    sample_from_probs,
)

# Probabilities of the worked examples; logits = log(probs) so softmax gives them back.
GOLDEN_PROBS = torch.tensor([0.5, 0.3, 0.15, 0.05])
GOLDEN_LOGITS = GOLDEN_PROBS.log()


def test_disabled_filters_are_plain_softmax() -> None:
    logits = torch.randn(3, 11, generator=torch.Generator().manual_seed(0))
    probs = logits_to_probs(logits, SamplingParams())
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_temperature_matches_softmax_of_scaled_logits() -> None:
    logits = torch.tensor([[1.0, 2.0, -0.5, 0.0], [3.0, 3.0, 1.0, -2.0]])  # [2, 4]
    probs = logits_to_probs(logits, SamplingParams(temperature=0.7))
    torch.testing.assert_close(probs, torch.softmax(logits / 0.7, -1))
    # A golden number, independent of torch.softmax: p0 = 1 / sum(exp((l - l0) / T)).
    expected = 1.0 / sum(math.exp((x - 1.0) / 0.7) for x in (1.0, 2.0, -0.5, 0.0))
    assert probs[0, 0].item() == pytest.approx(expected, rel=1e-6)


def test_greedy_is_one_hot_with_ties_to_lowest_id() -> None:
    logits = torch.tensor([[1.0, 3.0, 3.0, 0.0], [0.0, -1.0, 5.0, 2.0]])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0))
    expected = torch.tensor([[0.0, 1.0, 0.0, 0.0], [0.0, 0.0, 1.0, 0.0]])
    torch.testing.assert_close(probs, expected)
    assert probs.dtype == torch.float32


def test_greedy_sees_penalties() -> None:
    # Token 0 leads, but it was in the prompt: 2.0 / 4 = 0.5 < 1.5, so token 1 wins.
    logits = torch.tensor([2.0, 1.5, 0.0])
    prompt_mask = torch.tensor([True, False, False])
    probs = logits_to_probs(logits, SamplingParams(temperature=0.0, repetition_penalty=4.0), None, prompt_mask)
    torch.testing.assert_close(probs, torch.tensor([0.0, 1.0, 0.0]))


def test_top_k_keeps_exactly_k() -> None:
    logits = torch.tensor([[0.1, 2.0, -1.0, 1.5, 0.7], [5.0, 4.0, 3.0, 2.0, 1.0]])  # [2, 5]
    probs = logits_to_probs(logits, SamplingParams(top_k=2))
    assert (probs > 0).sum(-1).tolist() == [2, 2]
    expected = torch.zeros(2, 5)
    expected[0, [1, 3]] = torch.softmax(torch.tensor([2.0, 1.5]), -1)
    expected[1, [0, 1]] = torch.softmax(torch.tensor([5.0, 4.0]), -1)
    torch.testing.assert_close(probs, expected)


@pytest.mark.parametrize("top_k", [-1, 0, 4, 10])
def test_top_k_disabled_or_at_least_vocab_keeps_everything(top_k: int) -> None:
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(top_k=top_k))
    torch.testing.assert_close(probs, GOLDEN_PROBS)


def test_top_p_golden() -> None:
    # Mass of the first two is exactly 0.8: the smallest set reaching top_p is {0, 1}.
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(top_p=0.81))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)


def test_top_p_always_keeps_the_top_token() -> None:
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(top_p=1e-9))
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_top_p_works_in_vocab_order() -> None:
    # Same distribution, shuffled: the kept tokens follow their ids.
    order = torch.tensor([2, 0, 3, 1])
    probs = logits_to_probs(GOLDEN_LOGITS[order], SamplingParams(top_p=0.8))
    torch.testing.assert_close(probs, torch.tensor([0.0, 0.625, 0.0, 0.375]))


@pytest.mark.parametrize("top_k", [-1, 4, 3])
def test_min_p_golden(top_k: int) -> None:
    # min_p=0.2: threshold 0.2 * 0.5 = 0.1 drops only 0.05.
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(min_p=0.2, top_k=top_k))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # min_p=0.7: threshold 0.35 keeps the top token only.
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(min_p=0.7, top_k=top_k))
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_filters_compose_in_order() -> None:
    # top_k=3 renormalises to [0.5, 0.3, 0.15] / 0.95 = [0.526, 0.316, 0.158] (the top-k code path).
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(top_k=3))
    torch.testing.assert_close(probs, torch.tensor([0.5, 0.3, 0.15, 0.0]) / 0.95)
    # top_p=0.81 then acts on the renormalised mass: 0.526 + 0.316 = 0.842 >= 0.81 keeps {0, 1}.
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(top_k=3, top_p=0.81))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # top_p=0.9 keeps all three, and min_p=0.4 drops 0.158 (< 0.4 * 0.526).
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(top_k=3, top_p=0.9, min_p=0.4))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))
    # min_p after top-p: 0.375 < 0.7 * 0.625 leaves the top token.
    probs = logits_to_probs(GOLDEN_LOGITS, SamplingParams(top_k=3, top_p=0.81, min_p=0.7))
    torch.testing.assert_close(probs, torch.tensor([1.0, 0.0, 0.0, 0.0]))


def test_repetition_penalty_golden() -> None:
    logits = torch.tensor([2.0, -1.0, 0.5, 1.0])
    prompt_mask = torch.tensor([True, False, False, False])
    counts = torch.tensor([0, 1, 0, 0])
    params = SamplingParams(repetition_penalty=2.0)
    penalised = apply_penalties(logits, params, counts, prompt_mask)
    # Token 0 (prompt, positive): 2 / 2; token 1 (output, negative): -1 * 2; others untouched.
    torch.testing.assert_close(penalised, torch.tensor([1.0, -2.0, 0.5, 1.0]))
    probs = logits_to_probs(logits, params, counts, prompt_mask)
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([1.0, -2.0, 0.5, 1.0]), -1))


def test_presence_and_frequency_penalties_golden() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]])  # [1, 4]
    counts = torch.tensor([[0, 2, 1, 0]])
    prompt_mask = torch.tensor([True, False, False, True])  # ignored by these two penalties
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    penalised = apply_penalties(logits, params, counts, prompt_mask)
    # Token 1: -1 - 0.5 - 2 * 0.25 = -2; token 2: 0.5 - 0.5 - 0.25 = -0.25.
    torch.testing.assert_close(penalised, torch.tensor([[2.0, -2.0, -0.25, 1.0]]))
    probs = logits_to_probs(logits, params, counts, prompt_mask)
    torch.testing.assert_close(probs, torch.softmax(torch.tensor([[2.0, -2.0, -0.25, 1.0]]), -1))


def test_penalties_do_not_modify_inputs_and_output_is_float32() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 1.0]], dtype=torch.bfloat16)
    before = logits.clone()
    probs = logits_to_probs(
        logits, SamplingParams(repetition_penalty=1.5, temperature=0.5), torch.tensor([[1, 0, 0, 1]])
    )
    assert probs.dtype == torch.float32
    assert torch.equal(logits, before)
    torch.testing.assert_close(probs.sum(-1), torch.ones(1))


def _reference_probs(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Slow float64 reference of logits_to_probs without penalties, written from the definitions."""
    x = logits.astype(np.float64) / params.temperature
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    order = np.argsort(-probs, kind="stable")
    keep = np.ones_like(probs, dtype=bool)
    if 0 < params.top_k < len(probs):
        keep[order[params.top_k :]] = False
    probs = np.where(keep, probs, 0.0) / probs[keep].sum()
    if params.top_p < 1.0:
        mass = 0.0
        for rank, token in enumerate(order):
            if rank > 0 and mass >= params.top_p:
                probs[token] = 0.0
            mass += probs[token]
        probs /= probs.sum()
    if params.min_p > 0:
        probs = np.where(probs < params.min_p * probs.max(), 0.0, probs)
        probs /= probs.sum()
    return probs


@settings(max_examples=60, deadline=None)
@given(
    seed=st.integers(0, 2**31 - 1),
    vocab=st.integers(2, 40),
    temperature=st.sampled_from([0.3, 0.7, 1.0, 1.8]),
    top_k=st.sampled_from([-1, 1, 2, 5, 50]),
    top_p=st.sampled_from([1.0, 0.95, 0.8, 0.5, 0.1]),
    min_p=st.sampled_from([0.0, 0.05, 0.3]),
)
def test_matches_slow_reference(
    seed: int, vocab: int, temperature: float, top_k: int, top_p: float, min_p: float
) -> None:
    params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p, min_p=min_p)
    logits = torch.randn(vocab, generator=torch.Generator().manual_seed(seed)) * 3
    probs = logits_to_probs(logits, params)
    expected = _reference_probs(logits.numpy(), params)
    np.testing.assert_allclose(probs.numpy(), expected, atol=1e-5)
    assert ((probs > 0).numpy() == (expected > 0)).all()


def test_block_output_counts_golden() -> None:
    base = torch.tensor([1, 0, 0, 2])
    counts = block_output_counts(base, torch.tensor([1, 1, 3]))
    expected = torch.tensor([[1, 0, 0, 2], [1, 1, 0, 2], [1, 2, 0, 2], [1, 2, 0, 3]])
    assert torch.equal(counts, expected)
    assert counts.dtype == base.dtype
    # Empty block: just the base counts, one row.
    assert torch.equal(block_output_counts(base, torch.tensor([], dtype=torch.long)), base.unsqueeze(0))


def test_block_output_counts_batched_matches_rows() -> None:
    base = torch.tensor([[1, 0, 0, 2], [0, 0, 3, 0]])  # [2, 4]
    tokens = torch.tensor([[1, 1, 3], [2, 0, 2]])  # [2, 3]
    batched = block_output_counts(base, tokens)  # [2, 4, 4]
    for row in range(2):
        assert torch.equal(batched[row], block_output_counts(base[row], tokens[row]))


def test_sample_from_probs_golden() -> None:
    probs = torch.tensor([0.25, 0.0, 0.25, 0.5])  # CDF [0.25, 0.25, 0.5, 1.0], exact in binary
    picks = [int(sample_from_probs(probs, u)) for u in (0.0, 0.1, 0.25, 0.49, 0.5, 0.99)]
    assert picks == [0, 0, 2, 2, 3, 3]  # u = 0.25 steps over the zero-probability token 1
    # Unnormalised rows and a batch of rows with their own uniforms.
    batch = torch.tensor([[2.0, 0.0, 3.0, 5.0], [0.0, 0.0, 1.0, 0.0]])
    assert sample_from_probs(batch, torch.tensor([0.45, 0.0])).tolist() == [2, 2]


def test_sample_from_probs_largest_uniform_avoids_trailing_zero() -> None:
    largest = 1.0 - 2.0**-53  # the largest float64 below 1
    for probs in ([0.3, 0.7, 0.0, 0.0], [1 / 3, 1 / 3, 1 / 3, 0.0], [0.1] * 7 + [0.0]):
        token = int(sample_from_probs(torch.tensor(probs, dtype=torch.float32), largest))
        assert probs[token] > 0


@settings(max_examples=200, deadline=None)
@given(
    probs=st.lists(
        st.one_of(st.just(0.0), st.floats(1e-30, 1.0), st.floats(1e-8, 1e-6)), min_size=1, max_size=30
    ).filter(lambda row: sum(row) > 0),
    uniform=st.one_of(st.floats(0.0, 1.0, exclude_max=True), st.just(0.0), st.just(1.0 - 2.0**-53)),
    dtype=st.sampled_from([torch.float32, torch.float64]),
)
def test_sample_from_probs_never_returns_zero_probability(
    probs: list[float], uniform: float, dtype: torch.dtype
) -> None:
    row = torch.tensor(probs, dtype=dtype)
    if row.sum() == 0:  # every entry underflowed in float32
        return
    token = int(sample_from_probs(row, uniform))
    assert 0 <= token < len(probs)
    assert row[token] > 0


def test_sample_from_probs_frequencies_follow_probs() -> None:
    # A fine uniform grid is a deterministic quadrature of the inverse CDF.
    probs = torch.tensor([0.1, 0.0, 0.25, 0.4, 0.0, 0.25])
    grid = (torch.arange(10_000, dtype=torch.float64) + 0.5) / 10_000
    tokens = sample_from_probs(probs.expand(10_000, -1), grid)
    freqs = torch.bincount(tokens, minlength=6).double() / 10_000
    torch.testing.assert_close(freqs, probs.double(), atol=2e-4, rtol=0)


def test_draw_uniforms_seeded_reproducibility() -> None:
    first = draw_uniforms(1000, torch.Generator().manual_seed(123))
    second = draw_uniforms(1000, torch.Generator().manual_seed(123))
    other = draw_uniforms(1000, torch.Generator().manual_seed(124))
    assert first.shape == (1000,)
    assert torch.equal(first, second)
    assert not torch.equal(first, other)
    assert bool(((first >= 0) & (first < 1)).all())
    probs = torch.softmax(torch.randn(1000, 7, generator=torch.Generator().manual_seed(0)), -1)
    assert torch.equal(sample_from_probs(probs, first), sample_from_probs(probs, second))
    assert draw_uniforms(5, None).shape == (5,)
