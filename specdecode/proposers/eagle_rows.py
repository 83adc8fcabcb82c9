"""The EAGLE head as a batch proposer: every drafting row's tree in one head forward per tree level.

The head's KV cache has one row per running request (`RowCache`), holding pair j (the target's feature at
position j + the token at j + 1) at slot j. A step feeds every drafting row's pairs not yet in its cache in
one padded forward (`row_packing.pack`; after a step, the accepted path with the target's true features), whose
last output per row is the head's predicted feature at the pending token; then every row's tree grows one
level per forward, each node's feature the head's own prediction at its parent. The output rows of the draft
vocabulary are one product for every row's nodes; each row keeps its own tree calibration, and so drafts what
it drafts alone (up to the float rounding of a wider forward).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from specdecode.cost_model import CostModel
from specdecode.heads.modules import EagleHead
from specdecode.model.kv_cache import KVCache
from specdecode.proposers.base import Capabilities, Draft, ProposeRow, SequenceView
from specdecode.proposers.nodes_worth_verifying import RowTreeValues, TreeValue, node_selector
from specdecode.proposers.row_cache import RowCache
from specdecode.proposers.row_packing import Packed, RowInput, forward_rows
from specdecode.proposers.tree_growth import TreeGrower, TreeLevel, level_width
from specdecode.sampling import SamplingParams
from specdecode.tree import MAX_TREE_NODES


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


@dataclass
class _Row:
    """One request's drafting state."""

    slot: int
    """Its row of the head's cache and of the feature store."""
    tree_value: TreeValue | None = None
    num_features: int = 0
    """Positions [0, num_features) whose target feature is known."""
    num_cached: int = 0
    """Pairs [0, num_cached) in the head's cache (pair j = feature j + token j+1)."""


class EagleRows(RowTreeValues):
    """A `BatchProposer` drafting with an EAGLE head for every row at once (see the module doc)."""

    name = "eagle"

    def __init__(self, head: EagleHead, max_len: int, tree_width: int = 0, tree_branching: int = 4,
                 max_rows: int | None = None) -> None:
        self.head = head
        self.tree_width, self.tree_branching = tree_width, tree_branching
        self.capabilities = Capabilities(tree_width=tree_width, target_hidden=True)
        self.size = max_len + MAX_TREE_NODES + 1  # one slot past the largest tree, for padding queries
        c = head.config
        self.cache = RowCache(lambda rows: KVCache(1, rows, c.num_kv_heads, self.size, c.head_dim, head.dtype,
                                                   head.device), max_rows)
        self.features: dict[int, torch.Tensor] = {}
        """Cache row -> the target's features of its request's positions [size, D] (kept for the next row)."""
        self.rows: dict[int, _Row] = {}
        self._cost = 0.0

    # ---- the protocol ----------------------------------------------------------------------------------

    def reserve(self, rows: int) -> None:
        self.cache.reserve(rows)

    def begin(self, key: int, seq: SequenceView) -> None:
        slot = self.cache.take()
        if slot not in self.features:
            self.features[slot] = torch.zeros(self.size, self.head.config.hidden_size, dtype=self.head.dtype,
                                              device=self.head.device)
        self.rows[key] = _Row(slot, self._tree_value())

    def release(self, key: int) -> None:
        row = self.rows.pop(key, None)
        if row is not None:
            self.cache.give(row.slot)

    @torch.inference_mode()
    def observe_hidden(self, key: int, hidden: torch.Tensor) -> None:
        """Target features [m, D] of the row's next m positions (prompt at prefill, kept tokens after a step); for
        a fused-feature head, the target's captured layers [m, k * D]. A row that never drafts has no state."""
        row = self.rows.get(key)
        if row is None:
            return
        m = hidden.shape[0]
        self.features[row.slot][row.num_features : row.num_features + m] = self.head.input_features(hidden)
        row.num_features += m

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        row = self.rows[key]
        if row.tree_value is not None:
            row.tree_value.observe(own_accepted)
        # Cached pairs used true features only; the accepted path is re-fed with its true features.
        row.num_cached = min(row.num_cached, row.num_features)

    def catch_up_tokens(self, key: int, seq: SequenceView) -> int:
        return 0

    def configure(self, cost: CostModel) -> None:
        super().configure(cost)
        if self._cost == 0.0 and cost.draft_step_seconds > 0:  # the engine's measurement (or a cached one) of
            self._cost = cost.draft_step_seconds  # this head: not timed again

    def step_cost_hint(self) -> float:
        """Seconds per draft level, measured once through `propose` itself (see `_level_seconds`)."""
        if self._cost == 0.0:
            self._cost = eagle_level_seconds(self.head, self.tree_branching)  # what the measuring step selects by
            self._cost = self._level_seconds()
        return self._cost

    @torch.inference_mode()
    def _level_seconds(self, context: int = 64, depth: int = 6, repeats: int = 3) -> float:
        """A step's draft cost per level as the engine pays it: a scratch row with `context` positions drafts a
        chain of `depth` levels (the catch-up forward that gives its root, each level's forward, output rows and
        tree growth), median of `repeats` after a warm-up. A bare single-node head forward misses what surrounds
        each forward (row packing, masks, output columns, growth), a large share of a level on a CPU."""
        key = -1  # no engine row has a negative key
        context = max(2, min(context, self.size - MAX_TREE_NODES - depth - 2))  # a short max_len leaves less room
        ids = [i % self.head.target_vocab_size for i in range(10, 10 + context + 1)]
        view = SequenceView(ids, context, SamplingParams(temperature=0.0), torch.Generator())
        self.begin(key, view)
        row = self.rows[key]
        row.num_features = context  # zero features: the cost does not depend on their values
        self.features[row.slot][:context] = 0
        samples = []
        try:
            for _ in range(repeats + 1):
                row.num_cached = 0 if not samples else context - 1  # a warm-up over the context, then a step's catch-up
                t0 = time.perf_counter()
                self.propose([ProposeRow(key, view, depth, depth)])
                samples.append((time.perf_counter() - t0) / depth)
        finally:
            self.release(key)
        return statistics.median(samples[1:])

    def catch_up_token_seconds(self) -> float:
        return 0.0

    def state_bytes(self, rows: int) -> int:
        """The head's KV cache rows (one layer's K and V) and the target's features kept per row."""
        c, width = self.head.config, self.head.dtype.itemsize
        return (c.hidden_size + 2 * c.num_kv_heads * c.head_dim) * width * self.size * rows

    # ---- drafting ----------------------------------------------------------------------------------------

    @torch.inference_mode()
    def propose(self, asks: list[ProposeRow]) -> list[Draft]:
        drafts = [Draft() for _ in asks]
        work = [i for i, ask in enumerate(asks) if ask.k > 0]
        if not work:
            return drafts
        roots = self._catch_up(asks, work)
        root_logits = self._logits(work, roots)
        growers: dict[int, TreeGrower] = {}
        node_features: dict[int, dict[int, torch.Tensor]] = {}
        for i in work:
            ask, row = asks[i], self.rows[asks[i].key]
            select = node_selector(row.tree_value, self.tree_width, lambda k=ask.k: k * self.step_cost_hint(),
                                   ask.node_budget)
            growers[i] = TreeGrower(root_logits[i], ask.k, level_width(self.tree_width, ask.node_budget, ask.k),
                                    self.tree_branching, row.num_cached, self.head.d2t, select)
            node_features[i] = {0: roots[i]}
        levels = {i: growers[i].next_level() for i in work}
        while active := [i for i in work if levels[i] is not None]:
            feeds, feats = {}, {}
            for i in active:
                level: TreeLevel = levels[i]  # type: ignore[assignment]
                slot = self.rows[asks[i].key].slot
                feeds[slot] = RowInput(level.tokens, level.positions, level.slots, level.mask)
                feats[slot] = torch.stack([node_features[i][p] for p in level.parents])  # [m, D]
            out = self._forward(feeds, feats)
            outs = {i: out[self.rows[asks[i].key].slot] for i in active}
            for i in active:
                for r, idx in enumerate(levels[i].nodes):  # type: ignore[union-attr]
                    node_features[i][idx] = outs[i][r]
            logits = self._logits(active, outs)
            for i in active:
                growers[i].expanded(logits[i])
                levels[i] = growers[i].next_level()
        for i in work:
            drafts[i] = growers[i].draft()
            row = self.rows[asks[i].key]
            self.cache.cache.set_length(row.slot, row.num_cached)  # type: ignore[union-attr]  # tree entries: scratch
        return drafts

    def _catch_up(self, asks: list[ProposeRow], work: list[int]) -> dict[int, torch.Tensor]:
        """Feed every row's pairs not yet in its cache, in one forward; the head's predicted feature at each
        row's pending token [D]."""
        feeds, feats = {}, {}
        for i in work:
            row, ids = self.rows[asks[i].key], asks[i].seq.token_ids
            last = len(ids) - 2  # the newest pair: feature of position n-2 + the pending token
            if row.num_features <= last:
                raise RuntimeError("the engine did not pass the target's hidden states to the EAGLE proposer")
            j0 = min(row.num_cached, last)  # re-run the newest pair if nothing new arrived (always >= 1 pair)
            pairs = list(range(j0, last + 1))
            feeds[row.slot] = RowInput(ids[j0 + 1 : last + 2], pairs, pairs)
            feats[row.slot] = self.features[row.slot][j0 : last + 1]
        out = self._forward(feeds, feats)
        roots = {}
        for i in work:
            row = self.rows[asks[i].key]
            roots[i] = out[row.slot][-1]
            row.num_cached = len(asks[i].seq.token_ids) - 1
        return roots

    def _forward(self, feeds: dict[int, RowInput], feats: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """One head forward over every cache row in use (rows without a feed only pad; a long catch-up runs
        alone): the predicted features [m, D] per fed row (`feats`: its input features [m, D])."""
        cache = self.cache.cache
        assert cache is not None
        dev, head = self.head.device, self.head

        def run(lo: int, hi: int, packed: Packed) -> torch.Tensor:
            x = torch.zeros(hi - lo, packed.tokens.shape[1], head.config.hidden_size, dtype=head.dtype, device=dev)
            for slot, f in feats.items():
                if lo <= slot < hi and packed.lengths[slot - lo]:  # fed in this forward
                    x[slot - lo, : f.shape[0]] = f
            return head(x, packed.tokens.to(dev), packed.positions.to(dev), cache.rows(lo, hi),
                        slots=packed.slots.to(dev), attn_mask=packed.mask.to(dev))  # [B, M, D]

        valid = {row.slot: row.num_cached for row in self.rows.values()}
        span = self.cache.span
        return forward_rows(feeds, span, [valid.get(r, 0) for r in range(span)], run)

    def _logits(self, which: list[int], hidden: dict[int, torch.Tensor]) -> dict[int, torch.Tensor]:
        """Each row's logits over the draft vocabulary, every row's in one product."""
        stacked = torch.cat([hidden[i].reshape(-1, hidden[i].shape[-1]) for i in which])  # [N, D]
        small = self.head.draft_logits(stacked).split([hidden[i].reshape(-1, stacked.shape[-1]).shape[0]
                                                       for i in which])
        return {i: s.reshape(*hidden[i].shape[:-1], -1) for i, s in zip(which, small, strict=True)}
