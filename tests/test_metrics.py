"""Golden tests of SpecStats on hand-made steps."""

from __future__ import annotations

import pytest

from specdecode.metrics import SpecStats

KEYS = [
    "steps",
    "draft_tokens",
    "accepted_tokens",
    "output_tokens",
    "mean_accepted_length",
    "acceptance_rate",
    "acceptance_by_position",
    "draft_seconds",
    "verify_seconds",
]


def test_empty_stats() -> None:
    s = SpecStats()
    assert s.mean_accepted_length == 0.0
    assert s.acceptance_rate == 0.0
    assert s.acceptance_by_position == []
    assert list(s.to_dict()) == KEYS


def test_plain_decoding_has_tau_one() -> None:
    s = SpecStats()
    for _ in range(5):
        s.observe(0, 0, 1, verify_seconds=0.1)
    assert s.steps == 5 and s.output_tokens == 5 and s.draft_tokens == 0
    assert s.mean_accepted_length == 1.0
    assert s.acceptance_rate == 0.0
    assert s.acceptance_by_position == []
    assert s.verify_seconds == pytest.approx(0.5)


def test_hand_made_steps_golden() -> None:
    s = SpecStats()
    s.observe(4, 4, 5, draft_seconds=0.01, verify_seconds=0.1)  # all accepted + bonus
    s.observe(4, 1, 2, draft_seconds=0.02, verify_seconds=0.1)  # reject at position 1
    s.observe(4, 0, 1, draft_seconds=0.03, verify_seconds=0.1)  # reject at position 0
    s.observe(2, 2, 3, draft_seconds=0.04, verify_seconds=0.2)  # shorter draft, all accepted
    assert s.steps == 4
    assert s.draft_tokens == 14
    assert s.accepted_tokens == 7
    assert s.output_tokens == 11
    assert s.drafted_by_position == [4, 4, 3, 3]
    assert s.accepted_by_position == [3, 2, 1, 1]
    assert s.mean_accepted_length == pytest.approx(11 / 4)
    assert s.acceptance_rate == pytest.approx(7 / 14)
    assert s.acceptance_by_position == pytest.approx([3 / 4, 2 / 4, 1 / 3, 1 / 3])
    d = s.to_dict()
    assert list(d) == KEYS
    assert d["mean_accepted_length"] == pytest.approx(2.75)
    assert d["acceptance_rate"] == pytest.approx(0.5)
    assert d["draft_seconds"] == pytest.approx(0.10)
    assert d["verify_seconds"] == pytest.approx(0.50)


def test_tree_step_uses_depth_for_positions() -> None:
    s = SpecStats()
    s.observe(10, 2, 3, draft_depth=4)  # 10 nodes, depth 4, path of 2 accepted
    assert s.draft_tokens == 10
    assert s.drafted_by_position == [1, 1, 1, 1]
    assert s.accepted_by_position == [1, 1, 0, 0]
    assert s.acceptance_rate == pytest.approx(0.2)


def test_merge_aggregates_requests() -> None:
    a, b = SpecStats(), SpecStats()
    a.observe(2, 1, 2, 0.5, 1.0)
    b.observe(4, 3, 4, 0.25, 2.0)
    b.observe(0, 0, 1)
    total = SpecStats().merge(a).merge(b)
    assert total.steps == 3
    assert total.draft_tokens == 6 and total.accepted_tokens == 4 and total.output_tokens == 7
    assert total.drafted_by_position == [2, 2, 1, 1]
    assert total.accepted_by_position == [2, 1, 1, 0]
    assert total.mean_accepted_length == pytest.approx(7 / 3)
    assert total.acceptance_rate == pytest.approx(4 / 6)
    assert total.draft_seconds == pytest.approx(0.75) and total.verify_seconds == pytest.approx(3.0)
    # The sources are untouched.
    assert a.steps == 1 and a.drafted_by_position == [1, 1]


def test_observe_rejects_inconsistent_counts() -> None:
    s = SpecStats()
    with pytest.raises(ValueError):
        s.observe(2, 3, 4)
    with pytest.raises(ValueError):
        s.observe(-1, 0, 1)
    assert s.steps == 0
