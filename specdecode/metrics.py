"""Speculative-decoding statistics: one object, fed one step at a time by ``observe()``.

Words as in the glossary of docs/design.md: a *step* is one target forward; *output tokens* of a
step = accepted + (recovered or bonus); τ (mean accepted length) = output tokens / steps,
so plain decoding has τ = 1; acceptance rate = accepted / draft tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


def _add_into(dst: list[int], src: list[int]) -> None:
    """dst += src elementwise, growing dst with zeros where src is longer."""
    if len(src) > len(dst):
        dst.extend([0] * (len(src) - len(dst)))
    for i, v in enumerate(src):
        dst[i] += v


@dataclass
class SpecStats:
    """Counters of one request (or, after ``merge``, of many)."""

    steps: int = 0
    """Target forwards (verify passes)."""
    draft_tokens: int = 0
    """Draft tokens proposed (tree: nodes)."""
    accepted_tokens: int = 0
    """Draft tokens the verifier kept."""
    output_tokens: int = 0
    """Tokens emitted (accepted + recovered/bonus, after stop truncation)."""
    draft_seconds: float = 0.0
    """Wall time spent proposing."""
    verify_seconds: float = 0.0
    """Wall time spent in the target forward and the verifier."""
    accepted_by_position: list[int] = field(default_factory=list)
    """[i] = steps whose draft token at position i (0-based) was accepted."""
    drafted_by_position: list[int] = field(default_factory=list)
    """[i] = steps that proposed a token at position i."""

    def observe(
        self,
        num_draft_tokens: int,
        num_accepted_tokens: int,
        num_output_tokens: int,
        draft_seconds: float = 0.0,
        verify_seconds: float = 0.0,
        *,
        draft_depth: int | None = None,
    ) -> None:
        """Record one step.

        Acceptance is a prefix: accepting ``a`` tokens means positions 0..a-1 were accepted.
        ``draft_depth`` is the number of positions offered; it defaults to
        ``num_draft_tokens`` (a chain) and is the longest path's length for a tree, whose
        ``num_draft_tokens`` counts nodes.
        """
        depth = num_draft_tokens if draft_depth is None else draft_depth
        if num_draft_tokens < 0 or num_output_tokens < 0 or depth < 0:
            raise ValueError(
                f"counts must be >= 0, got draft={num_draft_tokens}, output={num_output_tokens}, "
                f"depth={depth}"
            )
        if not 0 <= num_accepted_tokens <= min(num_draft_tokens, depth):
            raise ValueError(
                f"accepted tokens ({num_accepted_tokens}) must lie in 0..min(draft tokens "
                f"{num_draft_tokens}, draft depth {depth})"
            )
        self.steps += 1
        self.draft_tokens += num_draft_tokens
        self.accepted_tokens += num_accepted_tokens
        self.output_tokens += num_output_tokens
        self.draft_seconds += draft_seconds
        self.verify_seconds += verify_seconds
        # Both lists always have the same length (positions ever drafted).
        if depth > len(self.drafted_by_position):
            grow = depth - len(self.drafted_by_position)
            self.drafted_by_position.extend([0] * grow)
            self.accepted_by_position.extend([0] * grow)
        for i in range(depth):
            self.drafted_by_position[i] += 1
        for i in range(num_accepted_tokens):
            self.accepted_by_position[i] += 1

    @property
    def mean_accepted_length(self) -> float:
        """τ = output tokens / steps (includes the bonus/recovered token); 0.0 before any step."""
        return self.output_tokens / self.steps if self.steps else 0.0

    @property
    def acceptance_rate(self) -> float:
        """Accepted / draft tokens; 0.0 when nothing was drafted."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    @property
    def acceptance_by_position(self) -> list[float]:
        """[i] = fraction of the steps drafting position i that accepted it (unconditional)."""
        return [
            a / d if d else 0.0
            for a, d in zip(self.accepted_by_position, self.drafted_by_position, strict=True)
        ]

    def merge(self, other: SpecStats) -> SpecStats:
        """Add ``other``'s counters into this object (aggregating requests); returns self."""
        self.steps += other.steps
        self.draft_tokens += other.draft_tokens
        self.accepted_tokens += other.accepted_tokens
        self.output_tokens += other.output_tokens
        self.draft_seconds += other.draft_seconds
        self.verify_seconds += other.verify_seconds
        _add_into(self.accepted_by_position, other.accepted_by_position)
        _add_into(self.drafted_by_position, other.drafted_by_position)
        # Keep the two lists the same length if other's were (defensively) uneven.
        n = max(len(self.accepted_by_position), len(self.drafted_by_position))
        self.accepted_by_position.extend([0] * (n - len(self.accepted_by_position)))
        self.drafted_by_position.extend([0] * (n - len(self.drafted_by_position)))
        return self

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready summary (the keys reports and /metrics use)."""
        return {
            "steps": self.steps,
            "draft_tokens": self.draft_tokens,
            "accepted_tokens": self.accepted_tokens,
            "output_tokens": self.output_tokens,
            "mean_accepted_length": self.mean_accepted_length,
            "acceptance_rate": self.acceptance_rate,
            "acceptance_by_position": self.acceptance_by_position,
            "draft_seconds": self.draft_seconds,
            "verify_seconds": self.verify_seconds,
        }
