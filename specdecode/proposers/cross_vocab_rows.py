"""A draft model with another tokenizer than the target's, drafting chains for every row at once.

The draft reads the target's text in its own ids and drafts greedily in them; its continuation goes back to the
target as text, re-tokenized (proposers/text_bridge.py). Each step a row's draft ids are brought up to the
target's text (`TextBridge.sync`: the cache keeps the ids up to the last agreed text boundary and is fed the
rest, in one forward with every other drafting row's catch-up); then one forward per depth over the rows still
drafting, until a row's continuation spells k of the target's tokens, or it ends a text (a special token), or
it reaches its cap of draft ids.

Drafts are point masses in the target's ids (the draft's probabilities are over other ids and do not map onto
the target's exactly), so verification is lossless under greedy and sampling alike, and the draft is greedy in
every request: it draws no random numbers. A draft's last target token is kept though its boundary may still
move ("hel" + "lo" -> "hello"): drafting one more id to be sure costs a draft forward every step, a wrong last
token only its verification row.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdecode.model.config import ModelConfig
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import Draft, ProposeRow, SequenceView
from specdecode.proposers.draft_rows import DraftModelRows, _chain_input, draft_step_costs
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.proposers.text_bridge import DraftText, TextBridge
from specdecode.tree import MAX_TREE_NODES

CONTEXT_FACTOR = 1.5
"""The draft's cache holds this many of its ids per target position (a row whose text needs more stops
drafting): vocabularies differ by a few tens of percent on code and prose."""


def cross_vocab_context(cfg: ModelConfig, max_len: int) -> int:
    """Positions of the draft's cache for a target context of max_len tokens (within the draft's own reach)."""
    return min(cfg.max_position_embeddings, math.ceil(max_len * CONTEXT_FACTOR))


def draft_ids_cap(k: int) -> int:
    """Draft ids a chain may spend on k of the target's tokens."""
    return 2 * k + 2


@dataclass
class _Chain:
    """One row's chain in the draft's ids and what it spells in the target's."""

    k: int
    pending: bytes
    ids: list[int]
    target: list[int]
    ended: bool = False
    """The last id ends a text (a special token)."""

    def done(self) -> bool:
        return self.ended or len(self.target) >= self.k or len(self.ids) >= draft_ids_cap(self.k)

    def draft(self) -> Draft:
        return Draft(self.target[: self.k])


class CrossVocabDraftRows(DraftModelRows):
    """`DraftModelRows` over another vocabulary: chains only, drafted in the draft's ids (module doc)."""

    def __init__(self, model: Transformer, max_len: int, bridge: TextBridge, prompt_lookup: SuffixSource | None = None,
                 max_rows: int | None = None) -> None:
        super().__init__(model, cross_vocab_context(model.config, max_len), prompt_lookup=prompt_lookup,
                         max_rows=max_rows, window=None)
        self.bridge = bridge
        self.real = min(len(bridge.draft_bytes), model.config.vocab_size)
        """Draft rows the tokenizer has ids for (a padded output matrix is never argmax'd beyond them)."""
        self.texts: dict[int, DraftText] = {}
        self._proposed: dict[int, int] = {}
        """Rows that drafted this step -> the target's length when they did."""
        self._seen: dict[int, int] = {}
        """Target tokens whose text each row's draft has read or spelled."""

    def begin(self, key: int, seq: SequenceView) -> None:
        super().begin(key, seq)
        self.texts[key] = DraftText()
        self._seen[key] = 0

    def release(self, key: int) -> None:
        super().release(key)
        self.texts.pop(key, None)
        self._seen.pop(key, None)
        self._proposed.pop(key, None)

    def on_verified(self, key: int, seq: SequenceView, num_accepted: int, own_accepted: int) -> None:
        at = self._proposed.pop(key, None)
        if at is not None:  # the accepted tokens are the draft's own text; the target's next one is new
            self._seen[key] = at + own_accepted

    def catch_up_tokens(self, key: int, seq: SequenceView) -> int:
        lag = len(seq.token_ids) - self._seen[key]
        return 0 if lag <= 1 else math.ceil(lag * self.bridge.draft_per_target)

    def _measure_costs(self) -> tuple[float, float]:
        """A draft id costs a draft forward; a target token needs `draft_per_target` of them."""
        step, catch_up = draft_step_costs(self.model, None, self.max_len + MAX_TREE_NODES)
        ratio = self.bridge.draft_per_target
        return step * ratio, catch_up * ratio

    @torch.inference_mode()
    def propose(self, asks: list[ProposeRow]) -> list[Draft]:
        drafts = [Draft() for _ in asks]
        chains: dict[int, _Chain] = {}
        feeds = {}
        for i, ask in enumerate(asks):
            if ask.k <= 0:
                continue
            row, text = self.rows[ask.key], self.texts[ask.key]
            keep = self.bridge.sync(text, ask.seq.token_ids, row.num_cached)
            row.num_cached = keep
            if not text.ids or len(text.ids) + draft_ids_cap(ask.k) >= self.max_len:
                continue  # nothing to read yet, or no room left in the draft's cache
            keep = min(keep, len(text.ids) - 1)  # the newest id is fed (again) for the logits after it
            feeds[row.slot] = _chain_input(text.ids[keep:], keep)
            row.num_cached = keep
            chains[i] = _Chain(ask.k, text.pending, [], [])
            self._proposed[ask.key] = len(ask.seq.token_ids)
        try:
            if feeds:
                out = self._forward(feeds, last_only=True)
                for i in chains:
                    self.rows[asks[i].key].num_cached = len(self.texts[asks[i].key].ids)
                self._grow(asks, chains, out)
        finally:
            for ask in asks:
                if ask.k > 0:
                    row = self.rows[ask.key]
                    self.cache.cache.set_length(row.slot, row.num_cached)  # type: ignore[union-attr]
        for i, chain in chains.items():
            drafts[i] = chain.draft()
        return drafts

    def _grow(self, asks: list[ProposeRow], chains: dict[int, _Chain], out: dict[int, torch.Tensor]) -> None:
        """Pick each chain's next ids from its logits `out` (by cache row), feed them, until every chain is done.

        A forward feeds a chain's newest id and its lookup guess after it, in the draft's ids: the guess holds as
        long as the draft picks its ids, so a copied run costs one forward (as `ChainDraft`'s)."""
        fed: dict[int, list[int]] = {}  # ids each chain fed in the forward `out` holds ([]: the catch-up)
        while True:
            feeds = {}
            for i, chain in chains.items():
                row, text = self.rows[asks[i].key], self.texts[asks[i].key]
                if row.slot not in out:
                    continue
                ids, logits = fed.get(i, []), out[row.slot]  # logits [max(1, len(ids)), V]
                used = 0
                while True:
                    token = int(logits[used, : self.real].argmax())
                    self._extend(chain, token)
                    if chain.done() or used + 1 >= len(ids) or token != ids[used + 1]:
                        break
                    used += 1
                for t in ids[: used + 1]:  # the fed ids the draft agreed with stay in its cache
                    text.append(t, self.bridge.draft_bytes[t])
                row.num_cached = len(text.ids)
                if not chain.done():
                    fed[i] = [chain.ids[-1], *self._guess(asks[i].seq, chain)]
                    feeds[row.slot] = _chain_input(fed[i], row.num_cached)
            if not feeds:
                return
            out = self._forward(feeds)

    def _extend(self, chain: _Chain, token: int) -> None:
        """Append a drafted id to a chain and re-read its text in the target's ids."""
        bridge = self.bridge
        chain.ids.append(token)
        spelled = bridge.continuation(chain.ids)
        # A text end, or a continuation that does not spell the pending bytes, ends the chain.
        chain.ended = token in bridge.draft_special or not (
            spelled.startswith(chain.pending) or chain.pending.startswith(spelled))
        chain.target = bridge.to_target(chain.pending, spelled)

    def _guess(self, seq: SequenceView, chain: _Chain) -> list[int]:
        """The lookup's guess of what follows the chain's text, in the draft's ids ([] without one, or where the
        chain's text is not exactly its target ids' text)."""
        lookup, bridge = self.prompt_lookup, self.bridge
        if lookup is None or chain.pending:
            return []
        if bridge.target_spelling(chain.target) != bridge.continuation(chain.ids):
            return []
        guess = lookup.chain(seq.token_ids + chain.target, seq.tenant, chain.k - len(chain.target),
                             seq.params.greedy)
        return bridge.draft_spelling(bridge.target_spelling(guess))[
            : draft_ids_cap(chain.k) - len(chain.ids)]
