"""The batch proposer built from per-sequence proposers: one drafting state per row of the batch.

`propose` takes every row's request in one call; each row drafts with its own state (a Medusa row's newest
feature and tree calibration), so a row's drafts never depend on which rows share its batch. The proposers
built this way (n-gram, Medusa) hold no cache of their own, so they never catch up.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from specdecode.cost_model import CostModel
from specdecode.proposers.base import Capabilities, Draft, Proposer, ProposeRow, SequenceView
from specdecode.proposers.heads import MedusaProposer


class RowProposers:
    """A `BatchProposer` over per-sequence proposers made by `factory` (one per row, made at `begin`)."""

    def __init__(self, factory: Callable[[], Proposer]) -> None:
        self.factory = factory
        self.probe = factory()
        """Answers for all rows what does not depend on a sequence: name, capabilities, measured costs."""
        self.name = self.probe.name
        self.capabilities: Capabilities = self.probe.capabilities
        self.cost: CostModel | None = None
        self.rows: dict[int, Proposer] = {}

    def configure(self, cost: CostModel) -> None:
        self.cost = cost
        for proposer in (self.probe, *self.rows.values()):
            proposer.configure(cost)

    def reserve(self, rows: int) -> None:
        pass  # per-row proposers hold their own state, made at begin

    def begin(self, key: int, seq: SequenceView) -> None:
        proposer = self.factory()
        if self.cost is not None:
            proposer.configure(self.cost)
        proposer.begin(seq)
        self.rows[key] = proposer

    def release(self, key: int) -> None:
        self.rows.pop(key, None)

    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        return [self.rows[r.key].propose(r.seq, r.k, r.node_budget) for r in rows]

    def observe_hidden(self, key: int, hidden: torch.Tensor) -> None:
        if key in self.rows:  # a row that never drafts (k = 0 asked) has no proposer
            self.rows[key].observe_hidden(hidden)

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        self.rows[key].on_verified(seq, num_accepted, own_accepted)

    def catch_up_tokens(self, key: int, seq: SequenceView) -> int:
        return 0  # a per-sequence proposer holds no cache of its own to catch up

    def step_cost_hint(self) -> float:
        return self.probe.step_cost_hint()

    def catch_up_token_seconds(self) -> float:
        return 0.0


class MedusaRows(RowProposers):
    """Medusa rows: every drafting row's heads run in one forward over the rows' newest features."""

    @torch.inference_mode()
    def propose(self, rows: list[ProposeRow]) -> list[Draft]:
        proposers: list[MedusaProposer] = [self.rows[r.key] for r in rows]  # type: ignore[misc]
        ready = [i for i, p in enumerate(proposers) if p.last is not None]
        drafts = [Draft() for _ in rows]
        if ready:
            features = proposers[ready[0]].head(torch.stack([proposers[i].last for i in ready]))  # [K, R, D]
            for j, i in enumerate(ready):
                drafts[i] = proposers[i].propose_from(features[:, j], rows[i].k, rows[i].node_budget)
        return drafts
