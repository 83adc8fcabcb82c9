"""The one cost model: what a target forward over t tokens costs, what a drafter's step costs, and the tree
node budget that follows from them. Proposers and the engine both read it; it imports nothing of specdecode."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace


@dataclass(frozen=True)
class CostModel:
    """The one cost model of the engine: seconds of a target forward as a function of the tokens it verifies
    (all rows of the batch together), plus the drafter's costs. A single request's step with draft length k
    is a forward over its k + 1 tokens (`step_seconds`); a batch step is a forward over every row's tokens
    (`target_forward_seconds` of the total), which is how trees shrink under load (engine/schedule.py)."""

    target_seconds: tuple[float, ...]
    """[t-1] = seconds of one target forward over t tokens in all (t = 1..T); linear beyond."""
    draft_step_seconds: float = 0.0
    """Seconds per drafted token (one draft-model step); 0 for n-gram."""
    draft_overhead_seconds: float = 0.0
    """Fixed seconds of a step with k > 0 (the draft's catch-up forward over accepted tokens)."""
    tree_nodes: tuple[int, ...] = ()
    """Tree proposers: [k-1] = draft nodes verified at depth k by a request alone; empty for a chain."""
    catch_up_token_seconds: float = 0.0
    """Seconds per token a drafter spends catching up on context it has not seen (draft-model prefill)."""

    def __post_init__(self) -> None:
        if not self.target_seconds:
            raise ValueError("target_seconds needs at least the 1-token forward time")
        if any(s <= 0 for s in self.target_seconds):
            raise ValueError(f"target_seconds must be > 0, got {self.target_seconds}")
        if self.draft_step_seconds < 0 or self.draft_overhead_seconds < 0:
            raise ValueError(
                f"draft costs must be >= 0, got draft_step_seconds={self.draft_step_seconds}, "
                f"draft_overhead_seconds={self.draft_overhead_seconds}"
            )

    @classmethod
    def from_points(
        cls,
        points: Mapping[int, float],
        max_tokens: int,
        draft_step_seconds: float = 0.0,
        draft_overhead_seconds: float = 0.0,
        tree_nodes: tuple[int, ...] = (),
        catch_up_token_seconds: float = 0.0,
    ) -> CostModel:
        """Build the table for t = 1..max_tokens from a few measured forwards ({t: seconds}).

        Linear interpolation between measured t, linear extrapolation beyond (as
        ``target_forward_seconds``); e.g. an int8 1.5B target on two threads: {1: .036, 4: .070, 8: .074}.
        """
        if 1 not in points:
            raise ValueError(f"points must include t=1, got {sorted(points)}")
        ts = sorted(points)
        table = []
        for t in range(1, max_tokens + 1):
            table.append(_piecewise_linear(ts, [points[x] for x in ts], t))
        return cls(tuple(table), draft_step_seconds, draft_overhead_seconds, tree_nodes, catch_up_token_seconds)

    def with_tree_nodes(self, tree_nodes: tuple[int, ...]) -> CostModel:
        """The same costs with a tree proposer's verified nodes per depth (a request alone)."""
        return replace(self, tree_nodes=tree_nodes)

    def target_forward_seconds(self, t: int) -> float:
        """Seconds of a target forward over t >= 1 new tokens.

        Beyond the table: extend the line through the last two entries (slope clamped at
        >= 0, a longer forward is never cheaper); a one-entry table is taken as flat.
        """
        if t < 1:
            raise ValueError(f"a target forward covers at least 1 token, got t={t}")
        table = self.target_seconds
        if t <= len(table):
            return table[t - 1]
        slope = max(0.0, table[-1] - table[-2]) if len(table) >= 2 else 0.0
        return table[-1] + slope * (t - len(table))

    def step_seconds(self, k: int) -> float:
        """Seconds of one step with draft length k: target over k+1 tokens plus k draft steps."""
        if k < 0:
            raise ValueError(f"k must be >= 0, got {k}")
        nodes = self.tree_nodes[min(k, len(self.tree_nodes)) - 1] if (self.tree_nodes and k > 0) else k
        seconds = self.target_forward_seconds(nodes + 1) + k * self.draft_step_seconds
        if k > 0:
            seconds += self.draft_overhead_seconds
        return seconds


def _piecewise_linear(xs: list[int], ys: list[float], x: int) -> float:
    """Linear interpolation through sorted (xs, ys); linear extrapolation (slope >= 0) beyond."""
    if len(xs) == 1:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i] or i == len(xs) - 1:
            x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
            slope = (y1 - y0) / (x1 - x0)
            if x > x1:
                slope = max(0.0, slope)
            return y0 + slope * (x - x0)
    raise AssertionError("unreachable")


TREE_COST_SLACK = 1.3
"""A tree may hold as many nodes as a target forward verifies for at most this multiple of the cost of
one token (the memory-bound plateau of a bf16 or int8 target)."""


def tree_node_budget(cost: CostModel, k_max: int, rows: int = 1, max_nodes: int = 64) -> int:
    """Draft nodes per row (up to max_nodes) that verification affords almost for free when `rows` rows share
    the forward: the most n with a forward over rows * (n + 1) tokens within TREE_COST_SLACK of a forward
    over one token per row; at least k_max (a full chain). Under load the budget falls toward a chain."""
    rows = max(1, rows)
    limit = TREE_COST_SLACK * cost.target_forward_seconds(rows)
    fits = [n for n in range(max_nodes + 1) if cost.target_forward_seconds(rows * (n + 1)) <= limit]
    return max([k_max, *fits])
