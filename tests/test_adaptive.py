"""Tests of the adaptive draft length: cost model, acceptance tracker, choose_k, AdaptiveK."""

from __future__ import annotations

import itertools
import random

import pytest

from specdecode.cost_model import CostModel
from specdecode.engine.adaptive import AcceptanceTracker, AdaptiveK, choose_k

# Measured shapes of a Qwen 1.5B target on 2 CPU threads.
INT8_TARGET = CostModel.from_points({1: 0.036, 4: 0.070, 8: 0.074, 16: 0.147}, max_tokens=17)
FLAT = CostModel(tuple([0.1] * 9))


# ---------------------------------------------------------------------------- CostModel


def test_step_seconds_golden() -> None:
    cost = CostModel((1.0, 1.5, 2.5), draft_step_seconds=0.25, draft_overhead_seconds=0.5)
    assert cost.step_seconds(0) == pytest.approx(1.0)  # plain: no draft cost at all
    assert cost.step_seconds(1) == pytest.approx(1.5 + 0.25 + 0.5)
    assert cost.step_seconds(2) == pytest.approx(2.5 + 0.5 + 0.5)
    # Beyond the table: extend the last segment (slope 1.0 per token).
    assert cost.step_seconds(3) == pytest.approx(3.5 + 0.75 + 0.5)
    assert cost.step_seconds(5) == pytest.approx(5.5 + 1.25 + 0.5)


def test_extrapolation_never_decreases_and_single_entry_is_flat() -> None:
    falling = CostModel((0.2, 0.15))  # bf16: 2 tokens measured cheaper than 1
    assert falling.target_forward_seconds(5) == pytest.approx(0.15)
    assert CostModel((0.3,)).target_forward_seconds(8) == pytest.approx(0.3)


def test_from_points_interpolates() -> None:
    assert INT8_TARGET.target_seconds[0] == pytest.approx(0.036)
    assert INT8_TARGET.target_forward_seconds(2) == pytest.approx(0.036 + 0.034 / 3)
    assert INT8_TARGET.target_forward_seconds(6) == pytest.approx(0.072)
    assert INT8_TARGET.target_forward_seconds(12) == pytest.approx(0.1105)
    assert INT8_TARGET.target_forward_seconds(17) == pytest.approx(0.147 + 0.073 / 8)


def test_cost_model_validation() -> None:
    with pytest.raises(ValueError):
        CostModel(())
    with pytest.raises(ValueError):
        CostModel((0.1,), draft_step_seconds=-1.0)
    with pytest.raises(ValueError):
        FLAT.step_seconds(-1)


# ---------------------------------------------------------------------------- AcceptanceTracker


@pytest.mark.parametrize(
    ("alpha", "k", "expected"),
    [
        (0.5, 0, 1.0),
        (0.5, 1, 1.5),
        (0.5, 2, 1.75),
        (0.5, 3, 1.875),
        (0.8, 4, 1 + 0.8 + 0.64 + 0.512 + 0.4096),
        (1.0, 5, 6.0),
        (0.0, 5, 1.0),
    ],
)
def test_expected_tokens_constant_alpha(alpha: float, k: int, expected: float) -> None:
    tracker = AcceptanceTracker(prior=alpha)  # no observations: every position has α = prior
    assert tracker.expected_tokens(k) == pytest.approx(expected)
    # Closed form of the geometric sum, (1 - α^(k+1)) / (1 - α).
    if alpha < 1.0:
        assert expected == pytest.approx((1 - alpha ** (k + 1)) / (1 - alpha))


def test_tracker_update_prefix_semantics() -> None:
    tracker = AcceptanceTracker(prior=0.6, decay=0.9)
    tracker.update(num_drafted=3, num_accepted=1)  # position 0 accepted, 1 rejected, 2 unseen
    assert tracker.alpha(0) == pytest.approx(0.64)
    assert tracker.alpha(1) == pytest.approx(0.54)
    assert tracker.alpha(2) == pytest.approx(0.54)  # unseen: borrows the deepest observed
    assert tracker.expected_tokens(3) == pytest.approx(1 + 0.64 + 0.64 * 0.54 + 0.64 * 0.54**2)
    tracker.update(num_drafted=2, num_accepted=2)  # both accepted, no rejection observed
    assert tracker.alpha(0) == pytest.approx(0.676)
    assert tracker.alpha(1) == pytest.approx(0.586)
    tracker.update(num_drafted=0, num_accepted=0)  # empty draft: nothing observed
    assert tracker.alpha(0) == pytest.approx(0.676)
    with pytest.raises(ValueError):
        tracker.update(num_drafted=1, num_accepted=2)


def test_unseen_position_starts_from_borrowed_value() -> None:
    tracker = AcceptanceTracker(prior=0.6, decay=0.5)
    tracker.update(1, 0)  # α_0: 0.6 -> 0.3
    tracker.update(2, 2)  # α_0: 0.3 -> 0.65; α_1 starts from 0.3 (borrowed) -> 0.65
    assert tracker.alpha(0) == pytest.approx(0.65)
    assert tracker.alpha(1) == pytest.approx(0.65)


# ---------------------------------------------------------------------------- choose_k


def test_choose_k_zero_when_drafting_expensive_and_useless() -> None:
    cost = CostModel((0.1, 0.11, 0.12, 0.13), draft_step_seconds=0.03, draft_overhead_seconds=0.01)
    assert choose_k(AcceptanceTracker(prior=0.0), cost, k_max=8) == 0


def test_choose_k_tie_goes_to_smaller_k() -> None:
    # Free drafting, flat target, zero acceptance: every k gives 10 tokens/s.
    assert choose_k(AcceptanceTracker(prior=0.0), FLAT, k_max=8) == 0


def test_choose_k_max_when_everything_accepted_and_cost_flat() -> None:
    tracker = AcceptanceTracker(prior=0.999)
    assert choose_k(tracker, FLAT, k_max=8) == 8
    assert choose_k(tracker, FLAT, k_max=3) == 3
    assert choose_k(tracker, FLAT, k_max=0) == 0


def test_choose_k_follows_the_cost_curve() -> None:
    # int8 target: 8 tokens cost about as much as 4, 16 about twice as much as 8.
    # All accepted: 6 tokens / 72 ms beats 4 / 70 ms, and beyond 8 tokens the cost is ~linear.
    assert choose_k(AcceptanceTracker(prior=1.0), INT8_TARGET, k_max=5) == 5
    # α = 0.9: 5.7 tokens / 74 ms at k = 7 beats 8.1 tokens / 147 ms at k = 15.
    assert choose_k(AcceptanceTracker(prior=0.9), INT8_TARGET, k_max=16) == 7
    # Lower acceptance or a per-token draft cost shortens the draft.
    assert choose_k(AcceptanceTracker(prior=0.5), INT8_TARGET, k_max=16) == 1
    with_draft = CostModel(INT8_TARGET.target_seconds, draft_step_seconds=0.005)
    assert choose_k(AcceptanceTracker(prior=0.8), with_draft, k_max=16) == 6
    assert choose_k(AcceptanceTracker(prior=0.7), with_draft, k_max=16) == 1
    assert choose_k(AcceptanceTracker(prior=0.5), CostModel(INT8_TARGET.target_seconds, 0.01), k_max=16) == 0


# ---------------------------------------------------------------------------- AdaptiveK


def _simulate(
    policy: AdaptiveK, cost: CostModel, accept_prob: float, steps: int, k_max: int, seed: int = 0
) -> tuple[list[int], float, int]:
    """Run `steps` modelled steps: each draft position is accepted with prob accept_prob."""
    rng = random.Random(seed)
    ks: list[int] = []
    seconds, tokens = 0.0, 0
    for _ in range(steps):
        k = policy.next_k(k_max)
        accepted = 0
        while accepted < k and rng.random() < accept_prob:
            accepted += 1
        policy.observe(k, accepted)
        ks.append(k)
        seconds += cost.step_seconds(k)
        tokens += accepted + 1
    return ks, seconds, tokens


@pytest.mark.parametrize(
    "cost",
    [
        # Draft model: each drafted token costs 20% of a target forward.
        CostModel((0.1, 0.105, 0.11, 0.115, 0.12, 0.125, 0.13, 0.135, 0.14), draft_step_seconds=0.02),
        # N-gram: drafting is free, the target's multi-token forward is almost flat.
        CostModel((0.1, 0.105, 0.11, 0.115, 0.12, 0.125, 0.13, 0.135, 0.14)),
        INT8_TARGET,
    ],
    ids=["draft_model", "ngram_flat", "ngram_int8"],
)
def test_useless_drafter_falls_back_to_plain(cost: CostModel) -> None:
    policy = AdaptiveK(cost)
    ks, seconds, tokens = _simulate(policy, cost, accept_prob=0.0, steps=500, k_max=8)
    frac_drafting = sum(k > 0 for k in ks) / len(ks)
    assert frac_drafting < 0.10, frac_drafting
    plain_rate = 1.0 / cost.step_seconds(0)
    assert tokens / seconds >= 0.9 * plain_rate
    assert ks[-50:].count(0) >= 49  # settled at plain decoding (at most a rare probe)


def test_probes_back_off_and_recover_when_drafter_becomes_useful() -> None:
    cost = CostModel((0.1, 0.105, 0.11, 0.115, 0.12, 0.125, 0.13, 0.135, 0.14))
    policy = AdaptiveK(cost, probe_interval=16, max_probe_interval=64)
    ks, _, _ = _simulate(policy, cost, accept_prob=0.0, steps=300, k_max=8)
    settled = ks.index(0)
    probes = [i for i in range(settled, len(ks)) if ks[i] > 0]
    assert all(ks[i] == 1 for i in probes)  # a probe drafts exactly one token
    gaps = [b - a for a, b in itertools.pairwise(probes)]
    assert gaps[:3] == [33, 65, 65]  # 16 zeros, probe, 32 zeros, probe, then capped at 64
    assert all(g == 65 for g in gaps[1:])
    # The text turns repetitive: the drafter is now always right. Drafting resumes within
    # the current probe interval and climbs to k_max.
    ks2, _, _ = _simulate(policy, cost, accept_prob=1.0, steps=65 + 40, k_max=8)
    assert any(k > 0 for k in ks2[:65])
    assert ks2[-10:] == [8] * 10


@pytest.mark.parametrize("cost", [FLAT, INT8_TARGET], ids=["flat", "int8"])
def test_perfect_drafter_converges_to_k_max(cost: CostModel) -> None:
    policy = AdaptiveK(cost)
    ks, _, tokens = _simulate(policy, cost, accept_prob=1.0, steps=100, k_max=7)
    assert ks[-20:] == [7] * 20
    assert tokens >= 0.9 * 8 * 100


def test_k_max_allowed_is_respected() -> None:
    policy = AdaptiveK(FLAT, prior=1.0)
    assert policy.next_k(8) == 8
    assert policy.next_k(3) == 3
    assert policy.next_k(0) == 0
    assert policy.next_k(-2) == 0


def test_fixed_mode() -> None:
    policy = AdaptiveK(fixed_k=4)
    assert [policy.next_k(m) for m in (8, 4, 2, 0)] == [4, 4, 2, 0]
    for _ in range(50):  # a useless drafter does not change a user's fixed k
        policy.observe(4, 0)
    assert policy.next_k(8) == 4
    assert AdaptiveK(FLAT, fixed_k=0).next_k(8) == 0


def test_adaptive_needs_cost_or_fixed_k() -> None:
    with pytest.raises(ValueError):
        AdaptiveK()
    with pytest.raises(ValueError):
        AdaptiveK(fixed_k=-1)


# ---------------------------------------------------------------------------- probing under a batch cap

# Many rows: a forward over 16 tokens costs much more than over 8, so widening 8 rows to two tokens does not pay
# for a drafter whose acceptance is unremarkable, though a lone row would draft.
BATCH = CostModel.from_points({1: 0.05, 8: 0.08, 16: 0.14}, 16)


def _batch_step(policy: AdaptiveK, accepted: int = 1) -> int:
    """One step of a row in a batch of 8 (the others never draft): its k after the batch cap, observed."""
    from specdecode.engine.schedule import PreferredDraft, choose_lengths

    plain = [PreferredDraft(0, AdaptiveK(fixed_k=0)) for _ in range(7)]
    k = choose_lengths([PreferredDraft(policy.next_k(4), policy), *plain], BATCH, 1, 4).ks[0]
    policy.observe(k, min(k, accepted))
    return k


def test_a_row_the_batch_keeps_at_k0_still_probes() -> None:
    """The row's own choice is k > 0, so it never chooses k = 0 itself; the batch cap sets it to 0 every step.
    The streak counts what the row drafted, after the cap: it probes, and a probe the batch of 8 defers for an
    interval per row runs anyway (a probe widens every row's forward: a batch probes about as often as a row
    alone)."""
    policy = AdaptiveK(CostModel.from_points({1: 0.05, 8: 0.055}, 8))  # its own (lone row) costs: drafting pays
    assert policy.next_k(4) > 0
    due = (1 + 8) * policy.probe_interval
    ks = [_batch_step(policy) for _ in range(due + 1)]
    assert ks == [0] * due + [1]  # deferred for an interval per row, then due
    assert policy.observed_positions == 1 and policy.accepted_positions == 1


def test_an_accepted_probe_resets_the_streak_and_a_rejected_one_widens_the_interval() -> None:
    policy = AdaptiveK(CostModel.from_points({1: 0.05, 8: 0.055}, 8))
    for _ in range(9 * policy.probe_interval + 1):
        _batch_step(policy, accepted=0)
    assert policy.probe_interval == 32  # the probe was rejected
    ks = [_batch_step(policy, accepted=0) for _ in range(9 * 32 + 1)]
    assert ks == [0] * 9 * 32 + [1]


def test_a_waiting_probe_rides_along_a_step_that_is_wide_anyway() -> None:
    """A row that drafts widens every row's forward (rows are padded to the widest): the probes the cap defers
    run with it, so the batch's probes share widened forwards."""
    from specdecode.engine.schedule import PreferredDraft, choose_lengths

    waiting = AdaptiveK(CostModel.from_points({1: 0.05, 8: 0.055}, 8))
    for _ in range(waiting.probe_interval):
        _batch_step(waiting)
    assert waiting.next_k(4) == 1 and waiting.probing and not waiting.probe_due(8)
    drafting = PreferredDraft(3, AdaptiveK(fixed_k=3))
    plain = [PreferredDraft(0, AdaptiveK(fixed_k=0)) for _ in range(6)]
    assert choose_lengths([PreferredDraft(1, waiting), drafting, *plain], BATCH, 1, 4).ks[:2] == [1, 3]
    assert choose_lengths([PreferredDraft(1, waiting), *plain], BATCH, 1, 4).ks[0] == 0  # nothing to ride


def test_a_forced_plain_step_is_not_counted() -> None:
    """No room to draft (the context or max_tokens is full) says nothing about the proposer."""
    policy = AdaptiveK(FLAT, prior=0.0)
    for _ in range(100):
        assert policy.next_k(0) == 0
        policy.observe(0, 0)
    assert policy.next_k(4) == 0 and not policy.probing


def test_the_policy_counts_observed_and_accepted_positions() -> None:
    policy = AdaptiveK(FLAT)
    policy.next_k(4)
    policy.observe(4, 2)  # positions 0, 1 accepted, 2 rejected, 3 unseen
    policy.next_k(4)
    policy.observe(3, 3)
    assert (policy.observed_positions, policy.accepted_positions) == (6, 5)


def test_a_drafter_that_never_pays_is_never_probed() -> None:
    """Draft steps cost ten target forwards: even a drafter whose every draft is kept loses to plain decoding, so
    a probe has nothing to teach."""
    policy = AdaptiveK(CostModel(tuple([0.01] * 9), draft_step_seconds=0.1), prior=1.0)
    for _ in range(200):
        assert policy.next_k(8) == 0 and not policy.probing
        policy.observe(0, 0)


def test_a_probe_the_lookup_guess_replaces_starts_a_new_interval() -> None:
    """The row proposed its lookup guess instead of the probe (the policy observes nothing that step): it waits a
    whole interval of plain steps before the next probe, rather than probing, and guessing, at every step."""
    policy = AdaptiveK(FLAT, prior=0.0)
    for _ in range(16):
        assert policy.next_k(8) == 0
        policy.observe(0, 0)
    assert policy.next_k(8) == 1 and policy.probing  # replaced by the guess: not observed
    ks = []
    for _ in range(17):
        ks.append(policy.next_k(8))
        policy.observe(ks[-1], 0)
    assert ks == [0] * 16 + [1]
