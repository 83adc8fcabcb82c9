"""How many prompt tokens a chunked prefill runs in one step while other rows decode.

A running stream waits for the chunk's forward on top of its own decode step, so the chunk is sized by time:
the largest that costs at most `CHUNK_STEP_RATIO` decode steps, at the per-token cost measured on earlier
chunks, within the configured token budget (`max_num_batched_tokens`). The streams' longest gap then stays
near (1 + ratio) times their usual one, whatever the hardware, and the long prompt still advances every step.
"""

from __future__ import annotations

CHUNK_STEP_RATIO = 1.5
"""A chunk may cost this many decode steps."""
MIN_CHUNK_TOKENS = 16
"""The smallest chunk (a prefix-cache block): below it a chunk's forward costs about as much as a bigger one."""
SMOOTHING = 0.5
"""Weight of the newest measurement in the running averages."""


def chunk_tokens(budget: int, decode_seconds: float | None, token_seconds: float | None,
                 ratio: float = CHUNK_STEP_RATIO, floor: int = MIN_CHUNK_TOKENS) -> int:
    """Tokens of the next chunk: at most `budget`, at least min(budget, floor); before anything is measured,
    the floor."""
    low = min(budget, floor)
    if decode_seconds is None or token_seconds is None or token_seconds <= 0:
        return low
    return max(low, min(budget, int(ratio * decode_seconds / token_seconds)))


def smoothed(old: float | None, new: float) -> float:
    return new if old is None else (1 - SMOOTHING) * old + SMOOTHING * new


class ChunkTimer:
    """The running averages a chunk is sized by: a step's decode phase, and a chunk's seconds per token
    (measured on chunks run while rows decode)."""

    def __init__(self) -> None:
        self.decode_seconds: float | None = None
        self.token_seconds: float | None = None

    def budget(self, max_tokens: int) -> int:
        return chunk_tokens(max_tokens, self.decode_seconds, self.token_seconds)

    def chunk_ran(self, tokens: int, seconds: float) -> None:
        if tokens >= MIN_CHUNK_TOKENS:  # a few tokens cost mostly the forward's fixed part: no measure
            self.token_seconds = smoothed(self.token_seconds, seconds / tokens)

    def decode_ran(self, seconds: float) -> None:
        self.decode_seconds = smoothed(self.decode_seconds, seconds)
