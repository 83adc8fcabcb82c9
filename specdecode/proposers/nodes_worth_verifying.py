"""How many nodes of a grown draft tree are worth verifying.

A node's chance of being accepted is about its cumulative draft probability (the product along its
path) times how well the drafter's confidence matches the target, which is learned live. Verifying n
nodes then yields ``1 + calibration * (p_1 + ... + p_n)`` tokens for ``draft + verify(n + 1)``
seconds; the n with the most tokens per second is kept (EAGLE-2 keeps a fixed top-N instead). A
weak drafter's low-probability branches are dropped, so its tree costs about what its chain costs.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from specdecode.cost_model import CostModel
    from specdecode.proposers.base import Capabilities


def best_node_count(probs: Sequence[float], calibration: float, draft_seconds: float,
                    verify_seconds: Callable[[int], float]) -> int:
    """n in [1, len(probs)] maximising (1 + calibration * sum(probs[:n])) / (draft + verify(n + 1)).

    `probs` are the nodes' acceptance estimates in the order they would be kept (descending, so
    every prefix is a valid subtree); verify(t) = seconds of a target forward over t tokens.
    """
    if not probs:
        return 0
    best_n, best_rate, total = 1, -math.inf, 0.0
    for n, p in enumerate(probs, 1):
        total += p
        rate = (1.0 + calibration * total) / (draft_seconds + verify_seconds(n + 1))
        if rate > best_rate:
            best_n, best_rate = n, rate
    return best_n


class TreeValue:
    """Per-request state of the node choice: the calibration of draft confidence against acceptance.

    calibration = (accepted + prior_weight) / (predicted + prior_weight), both sums decayed per step
    so the estimate follows a change of text; before any step it is 1 (the drafter's own word).
    """

    def __init__(self, verify_seconds: Callable[[int], float], decay: float = 0.9, prior_weight: float = 2.0) -> None:
        self.verify_seconds = verify_seconds
        self.decay = decay
        self.prior_weight = prior_weight
        self.accepted = 0.0
        self.predicted = 0.0
        self._pending: float | None = None
        """Predicted accepted tokens of the last tree handed out (None: nothing to learn from)."""

    def reset(self) -> None:
        self.accepted = self.predicted = 0.0
        self._pending = None

    @property
    def calibration(self) -> float:
        return (self.accepted + self.prior_weight) / (self.predicted + self.prior_weight)

    def keep(self, probs: Sequence[float], draft_seconds: float) -> int:
        """Nodes to verify out of `probs` (descending cumulative draft probabilities)."""
        n = best_node_count(probs, self.calibration, draft_seconds, self.verify_seconds)
        self._pending = sum(probs[:n])
        return n

    def observe(self, num_accepted: int) -> None:
        """Draft tokens the target accepted from the last kept tree."""
        if self._pending is None:
            return
        self.accepted = self.decay * self.accepted + num_accepted
        self.predicted = self.decay * self.predicted + self._pending
        self._pending = None


def node_selector(value: TreeValue | None, tree_width: int, draft_seconds: Callable[[], float],
                  node_budget: int | None = None) -> Callable[[list[float]], int] | None:
    """`grow_tree`'s select for a proposer whose drafting costs `draft_seconds()` (from its measured step
    cost, not a clock: the same seed must give the same tree); None for a chain, or before the engine
    has measured its forward costs (and with them the proposer's step cost). A dynamic-width tree
    (tree_width 0) keeps at most `node_budget` nodes: the engine's share of the batch forward for its row."""
    if tree_width == 1:
        return None
    cap = node_budget if (tree_width == 0 and node_budget is not None) else None
    if value is None:
        return None if cap is None else (lambda probs: min(len(probs), cap))
    if cap is None:
        return lambda probs: value.keep(probs, draft_seconds())
    return lambda probs: value.keep(probs[:cap], draft_seconds())


class RowTreeValues:
    """`configure` for a batch proposer whose rows each size their trees by a `TreeValue`: the target's measured
    forward cost prices the nodes, so every row (those running already included) gets a fresh one."""

    capabilities: Capabilities
    rows: dict[int, Any]
    """Key -> row state with a `tree_value` attribute."""
    target_seconds: Callable[[int], float] | None = None

    def configure(self, cost: CostModel) -> None:
        self.target_seconds = cost.target_forward_seconds
        for row in self.rows.values():
            row.tree_value = self._tree_value()

    def _tree_value(self) -> TreeValue | None:
        if not self.capabilities.trees or self.target_seconds is None:
            return None
        return TreeValue(self.target_seconds)
