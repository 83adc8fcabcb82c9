"""The draft model as a batch proposer: every drafting row of the batch in one draft forward per depth.

The draft's KV cache has one row per running request (`RowCache`). A step catches every drafting row up
(the prompt's last DRAFT_WINDOW tokens on its first draft, everything since it last drafted after a pause, else
just the newest token) in one padded forward (`row_packing.pack`), whose last position per row gives the first
draft token; then chains
advance every row by one forward per depth (rows riding a correct prompt-lookup guess finish in fewer), and
trees grow every row's next level in one forward with tree attention. Each row keeps its own tree
calibration, so its drafts do not depend on which rows share its batch (up to the float rounding of a wider
forward). Whether a row drafts at all or proposes its lookup guess alone is the engine's choice.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from specdecode.cost_model import CostModel
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import Capabilities, Draft, ProposeRow, SequenceView
from specdecode.proposers.draft_chain import ChainDraft
from specdecode.proposers.nodes_worth_verifying import RowTreeValues, TreeValue, node_selector
from specdecode.proposers.row_cache import RowCache
from specdecode.proposers.row_packing import Packed, RowInput, forward_rows
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.proposers.tree_growth import TreeGrower, level_width
from specdecode.tree import MAX_TREE_NODES

DRAFT_WINDOW = 256
"""Tokens a row's draft model reads when it starts (its first catch-up, or one after a longer pause): the
sequence's most recent ones. A draft predicts the next tokens from recent text (copies from further back come
from the lookup guesses, which read the whole sequence), and its prefill of a long prompt would cost more than a
short answer repays."""


def draft_input_ids(model: Transformer, vocab: tuple[int, int] | None, tokens: torch.Tensor) -> torch.Tensor:
    """A token beyond the draft's rows (a padding id the target emitted, vanishingly rare) is read as id 0:
    the draft's guesses after it get worse, never the output."""
    if vocab is None:
        return tokens
    return tokens.masked_fill(tokens >= model.config.vocab_size, 0)


def draft_logits(model: Transformer, vocab: tuple[int, int] | None, hidden: torch.Tensor) -> torch.Tensor:
    """[..., D] -> fp32 logits over the target's ids [..., V] (-inf on the target's rows the draft lacks)."""
    logits = model.compute_logits(hidden)
    if vocab is None:
        return logits
    real, rows = vocab
    out = logits.new_full((*logits.shape[:-1], rows), float("-inf"))
    out[..., :real] = logits[..., :real]
    return out


@torch.inference_mode()
def draft_step_costs(model: Transformer, vocab: tuple[int, int] | None, max_len: int) -> tuple[float, float]:
    """(seconds of a one-token draft forward, seconds per token of a catch-up forward), timed on a one-row cache
    of their own: the median of 5 single-token forwards after a warm-up feed of up to 64 tokens (a realistic
    cache, first-call overheads paid), and a second such feed for the catch-up."""
    cache = model.new_cache(1, max_len)
    warm = max(0, min(64, max_len - 6))  # a short context leaves less room for the warm-up and the samples
    dev = model.device

    def feed(n: int) -> float:
        start = cache.lengths[0]
        t0 = time.perf_counter()
        tokens = draft_input_ids(model, vocab, torch.ones(1, n, dtype=torch.long, device=dev))
        hidden = model(tokens, torch.arange(start, start + n, device=dev).unsqueeze(0), cache)  # [1, n, D]
        cache.set_length(0, start + n)
        draft_logits(model, vocab, hidden[0, -1:])
        return time.perf_counter() - t0

    if warm:
        feed(warm)
        cache.reset()
    catch_up = feed(warm) / max(1, warm) if warm else 0.0
    samples = [feed(1) for _ in range(max(1, min(6, max_len - warm)))]
    return statistics.median(samples[1:] or samples), catch_up


@dataclass
class _Row:
    """One request's drafting state."""

    slot: int
    """Its row of the draft's cache."""
    num_cached: int = 0
    """Tokens of the draft's window whose K/V are valid in that row (slots [0, num_cached))."""
    skipped: int = 0
    """Tokens before the draft's window, never fed: slot j holds the sequence's token skipped + j."""
    tree_value: TreeValue | None = None


class DraftModelRows(RowTreeValues):
    """A `BatchProposer` drafting with a draft model for every row at once (see the module doc)."""

    name = "draft"

    def __init__(self, model: Transformer, max_len: int, tree_width: int = 1, tree_branching: int = 2,
                 prompt_lookup: SuffixSource | None = None, vocab: tuple[int, int] | None = None,
                 max_rows: int | None = None, window: int | None = DRAFT_WINDOW) -> None:
        self.model, self.vocab, self.prompt_lookup = model, vocab, prompt_lookup
        self.window = window or max_len
        """The most recent tokens a row's draft reads at its first catch-up (`_window`; None: all)."""
        self.tree_width, self.tree_branching = tree_width, tree_branching
        self.capabilities = Capabilities(tree_width=tree_width, catch_up=True)
        self.max_len = max_len
        self._costs: tuple[float, float] | None = None
        """(step, catch-up per token) seconds, measured once (`draft_step_costs`)."""
        self.slots = max_len + MAX_TREE_NODES + 1  # one slot past the largest tree, for padding queries
        self.cache = RowCache(lambda rows: model.new_cache(rows, self.slots), max_rows)
        self.rows: dict[int, _Row] = {}
        self.forwards = 0
        """Batched draft forwards so far."""

    # ---- the protocol ----------------------------------------------------------------------------------

    def reserve(self, rows: int) -> None:
        self.cache.reserve(rows)

    def begin(self, key: int, seq: SequenceView) -> None:
        # Nothing is fed yet: the first propose catches the row up on the prompt, so a request that never
        # drafts never pays for the draft's prefill.
        self.rows[key] = _Row(self.cache.take(), tree_value=self._tree_value())

    def release(self, key: int) -> None:
        row = self.rows.pop(key, None)
        if row is not None:
            self.cache.give(row.slot)

    def observe_hidden(self, key: int, hidden: torch.Tensor) -> None:
        pass

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        row = self.rows[key]
        if row.tree_value is not None:
            row.tree_value.observe(own_accepted)
        # The cache holds the prefix plus the first k-1 draft tokens; keep only accepted ones.
        row.num_cached = min(row.num_cached, len(seq.token_ids) - 1 - row.skipped)

    def catch_up_tokens(self, key: int, seq: SequenceView) -> int:
        row = self.rows[key]
        lag = len(seq.token_ids) - row.skipped - row.num_cached
        return 0 if lag <= 1 else min(lag, self.window)

    def _window(self, row: _Row, length: int) -> None:
        """A catch-up longer than the window (a long prompt, or a long pause) starts the row's window afresh
        over the sequence's last `window` tokens: the draft drafts from recent text, and a long prompt costs
        it a bounded prefill, repaid by the few tokens a short answer leaves."""
        if length - row.skipped - row.num_cached > self.window:
            row.skipped, row.num_cached = length - self.window, 0

    def configure(self, cost: CostModel) -> None:
        super().configure(cost)
        if self._costs is None and cost.draft_step_seconds > 0:  # the engine's measurement (or a cached one) of
            self._costs = (cost.draft_step_seconds, cost.catch_up_token_seconds)  # this model: not timed again

    def step_cost_hint(self) -> float:
        if self._costs is None:
            self._costs = self._measure_costs()
        return self._costs[0]

    def _measure_costs(self) -> tuple[float, float]:
        """(seconds per drafted token, seconds per catch-up token), timed once."""
        return draft_step_costs(self.model, self.vocab, self.max_len + MAX_TREE_NODES)

    def catch_up_token_seconds(self) -> float:
        self.step_cost_hint()
        assert self._costs is not None
        return self._costs[1]

    def state_bytes(self, rows: int) -> int:
        """The draft's KV cache rows (`model.new_cache`'s K and V)."""
        return self.model.config.kv_bytes_per_token(self.model.dtype.itemsize) * self.slots * rows

    @torch.inference_mode()
    def propose(self, asks: list[ProposeRow]) -> list[Draft]:
        drafts = [Draft() for _ in asks]
        work = [i for i, ask in enumerate(asks) if ask.k > 0]
        if not work:
            return drafts
        # Catch-up of every drafting row in one forward: the logits after each row's newest token.
        feeds = {}
        for i in work:
            row, ids = self.rows[asks[i].key], asks[i].seq.token_ids
            self._window(row, len(ids))
            if row.skipped + row.num_cached >= len(ids):  # cannot happen once begin() ran; keeps it explicit
                raise RuntimeError("draft cache is ahead of the sequence")
            feeds[row.slot] = _chain_input(ids[row.skipped + row.num_cached :], row.num_cached)
        first = self._forward(feeds, last_only=True)
        for i in work:
            row = self.rows[asks[i].key]
            row.num_cached = len(asks[i].seq.token_ids) - row.skipped
        made = self._trees(asks, work, first) if self.capabilities.trees else self._chains(asks, work, first)
        for i, draft in made.items():
            drafts[i] = draft
        for i in work:
            row = self.rows[asks[i].key]
            self.cache.cache.set_length(row.slot, row.num_cached)  # type: ignore[union-attr]
        return drafts

    # ---- drafting ----------------------------------------------------------------------------------------

    def _chains(self, asks: list[ProposeRow], work: list[int], first: dict[int, torch.Tensor]) -> dict[int, Draft]:
        """Every row's chain, one forward per depth over the rows still drafting."""
        chains: dict[int, ChainDraft] = {}
        try:
            for i in work:
                row = self.rows[asks[i].key]
                chains[i] = ChainDraft(asks[i].seq, asks[i].k, self.prompt_lookup)
                chains[i].pick(first[row.slot][-1])
            while active := [i for i in work if not chains[i].done]:
                feeds, starts = {}, {}
                for i in active:
                    row = self.rows[asks[i].key]
                    starts[i] = row.num_cached
                    feeds[row.slot] = _chain_input(chains[i].next_feed(), row.num_cached)
                out = self._forward(feeds)
                for i in active:
                    row = self.rows[asks[i].key]
                    # Only the fed tokens the draft agreed with stay; entries past them were a wrong guess.
                    row.num_cached = starts[i] + chains[i].take(out[row.slot])
        finally:
            for chain in chains.values():  # grammar matchers stand where they stood, even if drafting failed
                chain.rollback()
        return {i: chains[i].draft() for i in work}

    def _trees(self, asks: list[ProposeRow], work: list[int], first: dict[int, torch.Tensor]) -> dict[int, Draft]:
        """Every row's tree, one forward with tree attention per level over the rows still growing. Tree
        entries past each row's prefix are scratch: the next propose re-feeds what was accepted."""
        growers = {}
        for i in work:
            ask, row = asks[i], self.rows[asks[i].key]
            select = node_selector(row.tree_value, self.tree_width, lambda k=ask.k: k * self.step_cost_hint(),
                                   ask.node_budget)
            growers[i] = TreeGrower(first[row.slot][-1], ask.k, level_width(self.tree_width, ask.node_budget, ask.k),
                                    self.tree_branching, row.num_cached, select=select)
        levels = {i: growers[i].next_level() for i in work}
        while active := [i for i in work if levels[i] is not None]:
            feeds = {}
            for i in active:
                level = levels[i]
                assert level is not None
                feeds[self.rows[asks[i].key].slot] = RowInput(level.tokens, level.positions, level.slots, level.mask)
            out = self._forward(feeds)
            for i in active:
                growers[i].expanded(out[self.rows[asks[i].key].slot])
                levels[i] = growers[i].next_level()
        return {i: growers[i].draft() for i in work}

    def _forward(self, feeds: dict[int, RowInput], last_only: bool = False) -> dict[int, torch.Tensor]:
        """One draft forward over every cache row in use (rows without a feed only pad; a long catch-up runs
        alone): fp32 logits over the target's ids per fed row, [m, V] after each fed token or [1, V] after the
        last."""
        cache = self.cache.cache
        assert cache is not None
        dev, model = self.model.device, self.model

        def run(lo: int, hi: int, packed: Packed) -> torch.Tensor:
            self.forwards += 1
            return model(draft_input_ids(model, self.vocab, packed.tokens.to(dev)), packed.positions.to(dev),
                         cache.rows(lo, hi), slots=packed.slots.to(dev), attn_mask=packed.mask.to(dev))  # [B, M, D]

        valid = {row.slot: row.num_cached for row in self.rows.values()}
        span = self.cache.span
        hidden = forward_rows(feeds, span, [valid.get(r, 0) for r in range(span)], run)
        picked = {r: h[-1:] if last_only else h for r, h in hidden.items()}
        logits = draft_logits(model, self.vocab, torch.cat(list(picked.values())))  # [N, V]
        return dict(zip(picked, logits.split([h.shape[0] for h in picked.values()]), strict=True))


def _chain_input(ids: list[int], start: int) -> RowInput:
    """Tokens appended to a row from slot `start` on (slot = position, causal)."""
    span = list(range(start, start + len(ids)))
    return RowInput(ids, span, span)
