"""Medusa heads as a batch proposer: k heads read the target's newest hidden state and each guesses one position
further; every drafting row's heads run in one forward over the rows' newest features.

The engine hands the target's final-norm hidden state of every position it keeps (`observe_hidden`), so
drafting needs no second model of the target's size and no cache: a row keeps its newest feature and its tree
calibration, so it drafts what it drafts alone (up to the float rounding of a wider forward).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from specdecode.heads.modules import MedusaHeads
from specdecode.proposers.base import Capabilities, Draft, ProposeRow, SequenceView
from specdecode.proposers.nodes_worth_verifying import RowTreeValues, TreeValue, node_selector
from specdecode.proposers.tree_growth import DEFAULT_NODE_BUDGET, TreeLevel, grow_tree, level_width


@torch.inference_mode()
def medusa_head_seconds(head: MedusaHeads) -> float:
    """Seconds per head of one run of every head and its output rows on one feature (median of 3 after a
    warm-up)."""
    assert head.blocks, "a Medusa head set needs at least one head"
    x = torch.zeros(head.config.hidden_size, dtype=head.dtype, device=head.device)
    samples = []
    for _ in range(4):
        t0 = time.perf_counter()
        head.draft_logits(head(x))
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:]) / len(head.blocks)


@dataclass
class _Row:
    """One request's drafting state."""

    tree_value: TreeValue | None = None
    last: torch.Tensor | None = None
    """[D] the target's feature at the newest kept position (None until the prefill's arrives)."""


class MedusaRows(RowTreeValues):
    """A `BatchProposer` drafting with Medusa heads for every row at once: every head reads the target's feature
    at the row's newest kept position; head i offers its top tokens for depth i + 1, and the tree keeps the
    candidates of highest joint head confidence."""

    name = "medusa"

    def __init__(self, head: MedusaHeads, tree_width: int = 0, tree_branching: int = 2) -> None:
        self.head = head
        self.tree_width, self.tree_branching = tree_width, tree_branching
        self.capabilities = Capabilities(tree_width=tree_width, target_hidden=True)
        self.rows: dict[int, _Row] = {}
        self._cost = 0.0

    # ---- the protocol ----------------------------------------------------------------------------------

    def reserve(self, rows: int) -> None:
        pass  # a row's state is made at begin and holds no cache

    def begin(self, key: int, seq: SequenceView) -> None:
        self.rows[key] = _Row(self._tree_value())

    def release(self, key: int) -> None:
        self.rows.pop(key, None)

    def observe_hidden(self, key: int, hidden: torch.Tensor) -> None:
        row = self.rows.get(key)
        if row is not None:  # a row that never drafts (k = 0 asked) has no state
            row.last = hidden[-1]

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        row = self.rows[key]
        if row.tree_value is not None:
            row.tree_value.observe(own_accepted)

    def catch_up_tokens(self, key: int, seq: SequenceView) -> int:
        return 0

    def step_cost_hint(self) -> float:
        """Seconds per drafted depth, measured once (`medusa_head_seconds`)."""
        if self._cost == 0.0:
            self._cost = medusa_head_seconds(self.head)
        return self._cost

    def catch_up_token_seconds(self) -> float:
        return 0.0

    def state_bytes(self, rows: int) -> int:
        return 0  # no cache: a row keeps one feature vector

    # ---- drafting ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, asks: list[ProposeRow]) -> list[Draft]:
        drafts = [Draft() for _ in asks]
        ready = [i for i, ask in enumerate(asks) if ask.k > 0 and self.rows[ask.key].last is not None]
        if ready:
            features = self.head(torch.stack([self.rows[asks[i].key].last for i in ready]))  # [K, R, D]
            for j, i in enumerate(ready):
                drafts[i] = self._tree(self.rows[asks[i].key], features[:, j], asks[i].k, asks[i].node_budget)
        return drafts

    def _tree(self, row: _Row, features: torch.Tensor, k: int, node_budget: int | None) -> Draft:
        """The row's tree from the heads' features [K, D] at its newest kept position."""
        depth = min(k, len(self.head.blocks))
        logits = self.head.draft_logits(features[:depth])  # [depth, Vd]

        def expand(level: TreeLevel) -> torch.Tensor:
            return logits[level.level + 1].expand(len(level.nodes), -1)

        width = level_width(self.tree_width, DEFAULT_NODE_BUDGET if node_budget is None else node_budget, depth)
        return grow_tree(logits[0], depth, width, self.tree_branching, 1, expand, token_map=self.head.d2t,
                         select=node_selector(row.tree_value, self.tree_width, lambda: depth * self.step_cost_hint(),
                                              node_budget))
