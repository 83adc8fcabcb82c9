"""Chunk sizing by time: pure arithmetic on measured seconds."""

from __future__ import annotations

from specdecode.engine.chunking import chunk_tokens, smoothed


def test_the_floor_before_anything_is_measured() -> None:
    assert chunk_tokens(256, None, None) == 16
    assert chunk_tokens(256, 0.2, None) == 16
    assert chunk_tokens(8, None, None) == 8  # a budget below the floor wins


def test_a_chunk_costs_at_most_ratio_decode_steps_within_the_budget() -> None:
    assert chunk_tokens(256, 0.2, 0.005) == 60  # 1.5 * 0.2 s / 5 ms per token
    assert chunk_tokens(40, 0.2, 0.005) == 40
    assert chunk_tokens(256, 0.01, 0.005) == 16  # never below the floor
    assert chunk_tokens(256, 0.2, 0.005, ratio=2.0) == 80


def test_smoothing() -> None:
    assert smoothed(None, 2.0) == 2.0
    assert smoothed(1.0, 3.0) == 2.0
