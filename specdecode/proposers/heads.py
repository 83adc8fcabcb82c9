"""Medusa heads as a per-sequence proposer: k heads read the target's newest hidden state and each guesses
one position further (`MedusaRows` runs every drafting row's heads in one forward).

The engine hands the target's final-norm hidden state of every position it keeps (`observe_hidden`), so
drafting needs no second model of the target's size.
"""

from __future__ import annotations

import statistics
import time

import torch

from specdecode.cost_model import CostModel
from specdecode.heads.modules import MedusaHeads
from specdecode.proposers.base import Capabilities, Draft, ProposerDefaults, SequenceView
from specdecode.proposers.head_columns import HeadColumns
from specdecode.proposers.tree_growth import (
    DEFAULT_NODE_BUDGET,
    TreeLevel,
    grow_tree,
    level_width,
)
from specdecode.proposers.tree_value import TreeValue, node_selector


class MedusaProposer(ProposerDefaults):
    """Medusa: every head reads the target's feature at the newest kept position; head i offers its
    top tokens for depth i + 1. The tree keeps the candidates of highest joint head confidence."""

    name = "medusa"

    def __init__(self, head: MedusaHeads, tree_width: int = 0, tree_branching: int = 2,
                 prompt_columns: bool = True) -> None:
        self.head = head
        self.columns = HeadColumns(head, prompt_columns)
        self.tree_width = tree_width
        self.tree_branching = tree_branching
        self.capabilities = Capabilities(tree_width=tree_width, target_hidden=True)
        self.tree_value: TreeValue | None = None
        self.last: torch.Tensor | None = None  # [D] target feature at position n-2
        self._cost = 0.0

    def configure(self, cost: CostModel) -> None:
        if self.capabilities.trees:
            self.tree_value = TreeValue(cost.target_forward_seconds)

    def begin(self, seq: SequenceView) -> None:
        if self.tree_value is not None:
            self.tree_value.reset()
        self.last = None
        self.columns.begin(seq.token_ids[: seq.prompt_len])

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        self.last = hidden[-1]

    @torch.inference_mode()
    def propose(self, seq: SequenceView, k: int, node_budget: int | None = None) -> Draft:
        if k <= 0 or self.last is None:
            return Draft()
        return self.propose_from(self.head(self.last), k, node_budget)

    @torch.inference_mode()
    def propose_from(self, features: torch.Tensor, k: int, node_budget: int | None = None) -> Draft:
        """The tree from the heads' features [K, D] at the newest kept position (`MedusaRows` computes them for
        every row in one head forward)."""
        depth = min(k, len(self.head.blocks))
        logits = self.columns.logits(features[:depth])  # [depth, Vd + extra columns]

        def expand(level: TreeLevel) -> torch.Tensor:
            return logits[level.level + 1].expand(len(level.nodes), -1)

        width = level_width(self.tree_width, DEFAULT_NODE_BUDGET if node_budget is None else node_budget, depth)
        return grow_tree(logits[0], depth, width, self.tree_branching, 1, expand, token_map=self.columns.token_map,
                         select=node_selector(self.tree_value, self.tree_width, lambda: depth * self.step_cost_hint(),
                                              node_budget))

    def on_verified(self, seq: SequenceView, num_accepted: int, own_accepted: int | None = None) -> None:
        if self.tree_value is not None and own_accepted is not None:
            self.tree_value.observe(own_accepted)

    def step_cost_hint(self) -> float:
        if self._cost == 0.0:
            assert self.head.blocks, "a Medusa head set needs at least one head"
            x = torch.zeros(self.head.config.hidden_size, dtype=self.head.dtype, device=self.head.device)
            samples = []
            with torch.inference_mode():
                for _ in range(4):
                    t0 = time.perf_counter()
                    self.head.draft_logits(self.head(x))
                    samples.append(time.perf_counter() - t0)
            self._cost = statistics.median(samples[1:]) / len(self.head.blocks)
        return self._cost
