"""Proposers that draft with heads reading the target's own hidden states (EAGLE, Medusa).

The engine hands them the target's final-norm hidden state of every position it keeps
(`observe_hidden`), so drafting needs no second model of the target's size.
"""

from __future__ import annotations

import statistics
import time

import torch

from specdecode.engine.adaptive import CostModel
from specdecode.heads.modules import EagleHead, MedusaHeads
from specdecode.proposers.base import Capabilities, Draft, ProposerDefaults, SequenceView
from specdecode.proposers.head_columns import HeadColumns
from specdecode.proposers.tree_growth import (
    DEFAULT_NODE_BUDGET,
    TreeLevel,
    grow_tree,
    level_width,
)
from specdecode.proposers.tree_value import TreeValue, node_selector
from specdecode.tree import MAX_TREE_NODES


class EagleProposer(ProposerDefaults):
    """EAGLE-2 style: the head runs on (feature, next token) pairs; its cache holds pair j at slot j.
    A tree is grown from the head's own predicted features; the next step re-feeds the accepted path
    with the target's true features."""

    name = "eagle"

    def __init__(self, head: EagleHead, max_len: int, tree_width: int = 0, tree_branching: int = 4,
                 prompt_columns: bool = True) -> None:
        self.head = head
        self.columns = HeadColumns(head, prompt_columns)
        self.tree_width = tree_width
        """Nodes kept per level; 0 = node_budget / depth."""
        self.tree_branching = tree_branching
        """Top-b expansion per node; 4 = SpeculativeConfig.tree_branching's default for "eagle"."""
        self.capabilities = Capabilities(tree_width=tree_width, target_hidden=True)
        self.tree_value: TreeValue | None = None
        """Set by `configure` (fed by `on_verified`): how much of a grown tree gets verified."""
        size = max_len + MAX_TREE_NODES
        self.cache = head.new_cache(size)
        self.features = torch.zeros(size, head.config.hidden_size, dtype=head.dtype, device=head.device)
        self.num_features = 0
        """Positions [0, num_features) whose target feature is known."""
        self.num_cached = 0
        """Pairs [0, num_cached) in the head's cache (pair j = feature j + token j+1)."""
        self._cost = 0.0

    def configure(self, cost: CostModel) -> None:
        if self.capabilities.trees:
            self.tree_value = TreeValue(cost.target_forward_seconds)

    def begin(self, seq: SequenceView) -> None:
        if self.tree_value is not None:
            self.tree_value.reset()
        self.cache.reset()
        self.num_features = 0
        self.num_cached = 0
        self.columns.begin(seq.token_ids[: seq.prompt_len])

    def observe_hidden(self, hidden: torch.Tensor) -> None:
        """Target features [m, D] of the next m positions (prompt at prefill, kept tokens after a step); for a
        fused-feature head, the target's captured layers [m, k * D]."""
        m = hidden.shape[0]
        with torch.inference_mode():
            self.features[self.num_features : self.num_features + m] = self.head.input_features(hidden)
        self.num_features += m

    @torch.inference_mode()
    def _catch_up(self, token_ids: list[int]) -> torch.Tensor:
        """Feed the pairs not yet in the cache; the head's predicted feature at the pending token [D]."""
        last = len(token_ids) - 2  # the newest pair: feature of position n-2 + the pending token
        if self.num_features <= last:
            raise RuntimeError("the engine did not pass the target's hidden states to the EAGLE proposer")
        j0 = min(self.num_cached, last)  # re-run the newest pair if nothing new arrived (always >= 1 pair)
        dev = self.head.device
        feats = self.features[j0 : last + 1][None]  # [1, m, D]
        toks = torch.tensor([token_ids[j0 + 1 : last + 2]], device=dev)
        pos = torch.arange(j0, last + 1, device=dev)[None]
        out = self.head(feats, toks, pos, self.cache)
        self.num_cached = last + 1
        self.cache.set_length(0, self.num_cached)
        return out[0, -1]

    @torch.inference_mode()
    def propose(self, seq: SequenceView, k: int, node_budget: int | None = None) -> Draft:
        if k <= 0:
            return Draft()
        head = self.head
        root = self._catch_up(seq.token_ids)
        base = self.num_cached
        node_features = {0: root}
        dev = head.device

        def expand(level: TreeLevel) -> torch.Tensor:
            feats = torch.stack([node_features[p] for p in level.parents])[None]  # [1, m, D]
            out = head(feats, level.tokens[None].to(dev), level.positions[None].to(dev), self.cache,
                       slots=level.slots[None].to(dev), attn_mask=level.mask[None].to(dev))[0]
            for row, idx in enumerate(level.nodes):
                node_features[idx] = out[row]
            return self.columns.logits(out)  # [m, Vd + extra columns]

        width = level_width(self.tree_width, DEFAULT_NODE_BUDGET if node_budget is None else node_budget, k)
        draft = grow_tree(self.columns.logits(root), k, width, self.tree_branching, base, expand,
                          token_map=self.columns.token_map,
                          select=node_selector(self.tree_value, self.tree_width, lambda: k * self.step_cost_hint(),
                                                node_budget))
        self.cache.set_length(0, base)  # tree entries are scratch
        return draft

    def on_verified(self, seq: SequenceView, num_accepted: int, own_accepted: int | None = None) -> None:
        if self.tree_value is not None and own_accepted is not None:
            self.tree_value.observe(own_accepted)
        # Cached pairs used true features only; the accepted path is re-fed with its true features.
        self.num_cached = min(self.num_cached, self.num_features)

    def step_cost_hint(self) -> float:
        """Seconds of one head level (a single-node forward plus its output rows), measured once."""
        if self._cost == 0.0:
            self._cost = eagle_level_seconds(self.head, self.tree_branching)
        return self._cost


@torch.inference_mode()
def eagle_level_seconds(head: EagleHead, branching: int) -> float:
    """Seconds of one EAGLE head level: a single-node forward plus its output rows (median of 5 after a
    warm-up, on a small cache of its own)."""
    cache = head.new_cache(8)
    feats = torch.zeros(1, 1, head.config.hidden_size, dtype=head.dtype, device=head.device)
    toks = torch.zeros(1, 1, dtype=torch.long, device=head.device)
    samples = []
    for i in range(6):
        t0 = time.perf_counter()
        out = head(feats, toks, torch.tensor([[i]], device=head.device), cache)
        head.draft_logits(out[0, -1]).topk(branching)
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples[1:])


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
