"""Golden and property tests for the reference chain verifiers (tests/reference_verify.py): rejection sampling
and the greedy fast path, which the tree verifiers equal on a chain (tests/test_tree_verify.py)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from reference_verify import verify_chain, verify_greedy

from specdecode.sampling import SamplingParams, logits_to_probs

# Vocabulary of 4. Row i of TARGET_PROBS / DRAFT_PROBS is the distribution at draft position i.
TARGET_PROBS = torch.tensor(
    [
        [0.1, 0.6, 0.2, 0.1],
        [0.1, 0.2, 0.3, 0.4],
        [0.25, 0.25, 0.25, 0.25],
        [0.0, 0.5, 0.0, 0.5],  # bonus row
    ]
)  # [k+1=4, V=4]
DRAFT_PROBS = torch.tensor(
    [
        [0.1, 0.3, 0.5, 0.1],
        [0.1, 0.1, 0.7, 0.1],
        [0.4, 0.2, 0.2, 0.2],
    ]
)  # [k=3, V=4]
DRAFT_TOKENS = torch.tensor([1, 2, 3])
# Acceptance ratios min(1, target/draft): position 0: 0.6/0.3 -> 1, position 1: 0.3/0.7 = 0.4286,
# position 2: 0.25/0.2 -> 1.


def _uniforms(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64)


def test_early_mismatch_recovers_from_residual() -> None:
    # u_1 = 0.5 >= 0.4286 rejects position 1. Residual max(target - draft, 0) = [0, 0.1, 0, 0.3],
    # i.e. [0, 0.25, 0, 0.75] normalised.
    accept = _uniforms(0.99, 0.5, 0.0)
    out, num_accepted = verify_chain(DRAFT_TOKENS, DRAFT_PROBS, TARGET_PROBS, accept, 0.2)
    assert num_accepted == 1
    assert out.tolist() == [1, 1]  # 0.2 < 0.25 -> token 1
    out, _ = verify_chain(DRAFT_TOKENS, DRAFT_PROBS, TARGET_PROBS, accept, 0.3)
    assert out.tolist() == [1, 3]  # 0.3 >= 0.25 -> token 3; token 2 (the rejected one) is impossible
    assert out.dtype == torch.long


def test_acceptance_threshold_is_strict() -> None:
    # Accept iff u * draft < target, exactly. Binary-exact numbers: target 0.25, draft 0.5, so u = 0.5
    # sits on the boundary and rejects; the largest float below it accepts.
    target = torch.tensor([[0.25, 0.75], [1.0, 0.0]])
    draft = torch.tensor([[0.5, 0.5]])
    tokens = torch.tensor([0])
    _, on_boundary = verify_chain(tokens, draft, target, _uniforms(0.5), 0.0)
    _, below = verify_chain(tokens, draft, target, _uniforms(0.5 - 2.0**-54), 0.0)
    assert (on_boundary, below) == (0, 1)
    # Point mass: accept iff u < target[x].
    _, on_boundary = verify_chain(tokens, None, target, _uniforms(0.25), 0.0)
    _, below = verify_chain(tokens, None, target, _uniforms(0.25 - 2.0**-55), 0.0)
    assert (on_boundary, below) == (0, 1)


def test_rejection_at_position_zero() -> None:
    # Draft token 2 at position 0: ratio 0.2 / 0.5 = 0.4; u = 0.45 rejects.
    # Residual [0, 0.3, 0, 0] -> token 1 whatever the sample uniform.
    draft_tokens = torch.tensor([2, 2, 3])
    for sample_uniform in (0.0, 0.5, 1.0 - 2.0**-53):
        out, num_accepted = verify_chain(
            draft_tokens, DRAFT_PROBS, TARGET_PROBS, _uniforms(0.45, 0.0, 0.0), sample_uniform
        )
        assert (out.tolist(), num_accepted) == ([1], 0)


def test_full_acceptance_samples_bonus_from_last_target_row() -> None:
    accept = _uniforms(0.9, 0.1, 0.9)  # 0.1 < 0.4286 accepts position 1
    out, num_accepted = verify_chain(DRAFT_TOKENS, DRAFT_PROBS, TARGET_PROBS, accept, 0.25)
    assert (out.tolist(), num_accepted) == ([1, 2, 3, 1], 3)  # bonus row [0, .5, 0, .5], 0.25 -> 1
    out, _ = verify_chain(DRAFT_TOKENS, DRAFT_PROBS, TARGET_PROBS, accept, 0.75)
    assert out.tolist() == [1, 2, 3, 3]


def test_empty_draft_samples_one_target_token() -> None:
    empty = torch.tensor([], dtype=torch.long)
    target = torch.tensor([[0.5, 0.0, 0.25, 0.25]])  # [1, V]
    for draft_probs in (None, torch.empty(0, 4)):
        out, num_accepted = verify_chain(empty, draft_probs, target, _uniforms(), 0.6)
        assert (out.tolist(), num_accepted) == ([2], 0)


def test_zero_target_probability_always_rejects() -> None:
    # Token 0 has target probability 0 at the bonus-row-like position; even u = 0 rejects.
    target = torch.tensor([[0.0, 0.5, 0.0, 0.5], [0.25, 0.25, 0.25, 0.25]])
    draft = torch.tensor([[0.7, 0.1, 0.1, 0.1]])
    for draft_probs in (draft, None):
        out, num_accepted = verify_chain(torch.tensor([0]), draft_probs, target, _uniforms(0.0), 0.1)
        assert (out.tolist(), num_accepted) == ([1], 0)


def test_zero_draft_probability_with_positive_target_accepts() -> None:
    # Documented rule: u * 0 < target is true, i.e. the ratio is +inf.
    target = torch.tensor([[0.0, 0.5, 0.0, 0.5], [1.0, 0.0, 0.0, 0.0]])
    draft = torch.tensor([[0.5, 0.0, 0.5, 0.0]])
    out, num_accepted = verify_chain(torch.tensor([1]), draft, target, _uniforms(0.99), 0.5)
    assert (out.tolist(), num_accepted) == ([1, 0], 1)


def test_point_mass_draft() -> None:
    # q(x) = 1: accept iff u < target[x]. Position 0: target[1] = 0.6.
    out, num_accepted = verify_chain(DRAFT_TOKENS, None, TARGET_PROBS, _uniforms(0.59, 0.31, 0.0), 0.0)
    # Position 1: u = 0.31 > target[2] = 0.3 rejects; recovered from target row 1 with token 2 zeroed:
    # [0.1, 0.2, 0, 0.4] -> u = 0 gives token 0.
    assert (out.tolist(), num_accepted) == ([1, 0], 1)
    out, num_accepted = verify_chain(DRAFT_TOKENS, None, TARGET_PROBS, _uniforms(0.61, 0.0, 0.0), 0.99)
    assert (out.tolist(), num_accepted) == ([3], 0)  # target row 0 without token 1: [.1, 0, .2, .1]
    out, num_accepted = verify_chain(DRAFT_TOKENS, None, TARGET_PROBS, _uniforms(0.0, 0.0, 0.2), 0.0)
    assert (out.tolist(), num_accepted) == ([1, 2, 3, 1], 3)


def test_residual_without_mass_falls_back_to_target() -> None:
    # Draft equals target, and the draft token has probability 0 in both (only float error or a
    # mismatched draft can get here): the residual is all zeros, so sample from target_probs.
    row = torch.tensor([0.5, 0.5, 0.0, 0.0])
    out, num_accepted = verify_chain(torch.tensor([2]), row.unsqueeze(0), torch.stack([row, row]), _uniforms(0.0), 0.7)
    assert (out.tolist(), num_accepted) == ([1], 0)


def test_shape_errors_are_clear() -> None:
    with pytest.raises(ValueError, match="k\\+1=4"):
        verify_chain(DRAFT_TOKENS, DRAFT_PROBS, TARGET_PROBS[:3], _uniforms(0, 0, 0), 0.0)
    with pytest.raises(ValueError, match="draft_probs"):
        verify_chain(DRAFT_TOKENS, DRAFT_PROBS[:2], TARGET_PROBS, _uniforms(0, 0, 0), 0.0)
    with pytest.raises(ValueError, match="target_argmax"):
        verify_greedy(DRAFT_TOKENS, torch.tensor([1, 2, 3]))


@pytest.mark.parametrize(
    ("draft", "target_argmax", "expected", "num_accepted"),
    [
        ([4, 5, 6], [4, 5, 6, 7], [4, 5, 6, 7], 3),  # all accepted + bonus
        ([4, 5, 6], [9, 5, 6, 7], [9], 0),  # mismatch at 0
        ([4, 5, 6], [4, 8, 6, 7], [4, 8], 1),  # mismatch in the middle; later matches do not count
        ([4, 5, 6], [4, 5, 0, 7], [4, 5, 0], 2),
        ([], [3], [3], 0),  # empty draft
    ],
)
def test_verify_greedy_golden(
    draft: list[int], target_argmax: list[int], expected: list[int], num_accepted: int
) -> None:
    out, accepted = verify_greedy(torch.tensor(draft, dtype=torch.long), torch.tensor(target_argmax))
    assert (out.tolist(), accepted) == (expected, num_accepted)


@settings(max_examples=150, deadline=None)
@given(
    data=st.data(),
    vocab=st.integers(2, 8),
    k=st.integers(0, 8),
    seed=st.integers(0, 2**31 - 1),
)
def test_verify_greedy_equals_chain_with_point_mass_and_one_hot_target(
    data: st.DataObject, vocab: int, k: int, seed: int
) -> None:
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(seed))  # [k+1, V]
    target_probs = logits_to_probs(logits, SamplingParams(temperature=0.0))  # one-hot rows
    target_argmax = logits.argmax(-1)  # [k+1]
    # Draft tokens mostly agree with the target so that long accepted prefixes are exercised.
    draft = [
        data.draw(st.one_of(st.just(int(target_argmax[i])), st.integers(0, vocab - 1)), label=f"draft[{i}]")
        for i in range(k)
    ]
    draft_tokens = torch.tensor(draft, dtype=torch.long)
    accept = torch.tensor(
        data.draw(st.lists(st.floats(0.0, 1.0, exclude_max=True), min_size=k, max_size=k)), dtype=torch.float64
    )
    sample_uniform = data.draw(st.floats(0.0, 1.0, exclude_max=True))
    chain_out, chain_accepted = verify_chain(draft_tokens, None, target_probs, accept, sample_uniform)
    greedy_out, greedy_accepted = verify_greedy(draft_tokens, target_argmax)
    assert chain_accepted == greedy_accepted
    assert chain_out.tolist() == greedy_out.tolist()


@settings(max_examples=150, deadline=None)
@given(vocab=st.integers(2, 8), k=st.integers(0, 6), seed=st.integers(0, 2**31 - 1), point_mass=st.booleans())
def test_verify_chain_output_invariants(vocab: int, k: int, seed: int, point_mass: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    # Sparse distributions (zeros from top-k) so that zero-probability cases come up often.
    params = SamplingParams(top_k=max(1, vocab // 2))
    target_probs = logits_to_probs(torch.randn(k + 1, vocab, generator=gen), params)  # [k+1, V]
    draft_probs = logits_to_probs(torch.randn(k, vocab, generator=gen), params)  # [k, V]
    draft_tokens = torch.multinomial(draft_probs, 1, generator=gen).view(k) if k else torch.zeros(0, dtype=torch.long)
    accept = torch.rand(k, generator=gen, dtype=torch.float64)
    sample_uniform = float(torch.rand(1, generator=gen, dtype=torch.float64))
    out, num_accepted = verify_chain(
        draft_tokens, None if point_mass else draft_probs, target_probs, accept, sample_uniform
    )
    assert 0 <= num_accepted <= k
    assert len(out) == num_accepted + 1
    assert out[:num_accepted].tolist() == draft_tokens[:num_accepted].tolist()
    # Every emitted token is possible under the target at its position.
    for position, token in enumerate(out.tolist()):
        assert target_probs[position, token] > 0
    if num_accepted < k:  # the recovered token never repeats a point-mass draft's rejected token
        if point_mass:
            assert out[-1] != draft_tokens[num_accepted]
