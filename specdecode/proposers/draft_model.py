"""A small model of the same tokenizer, run autoregressively, with its own KV cache.

Its precision never changes the output (the verifier corrects it), so it runs in
whatever format is fastest for one token at a time.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from specdecode.engine.adaptive import CostModel
from specdecode.model.kv_cache import KVCache
from specdecode.model.transformer import Transformer
from specdecode.proposers.base import Capabilities, Draft, ProposerDefaults, SequenceView
from specdecode.proposers.draft_chain import ChainDraft
from specdecode.proposers.lookup_choice import AcceptanceRate, guess_beats_draft
from specdecode.proposers.ngram_match import ngram_match
from specdecode.proposers.tree_growth import (
    DEFAULT_NODE_BUDGET,
    TreeLevel,
    grow_tree,
    level_width,
)
from specdecode.proposers.tree_value import TreeValue, node_selector
from specdecode.tree import MAX_TREE_NODES


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


class DraftModelProposer(ProposerDefaults):
    name = "draft"

    def __init__(
        self,
        model: Transformer,
        max_len: int,
        tree_width: int = 1,
        tree_branching: int = 2,
        prompt_lookup: tuple[int, int] | None = None,
        vocab: tuple[int, int] | None = None,
    ) -> None:
        self.model = model
        self.vocab = vocab
        """(real vocabulary, target's output rows) when the draft's output rows are padded differently from the
        target's (`validation.check_draft_rows`): its logits are cut to the tokenizer's real ids and laid out
        over the target's rows, -inf elsewhere, so a padding row is never proposed. None: same rows."""
        self.prompt_lookup = prompt_lookup
        """(min_n, max_n) to draft a chain with prompt-lookup guesses checked in one draft forward (see
        `_propose_chain`), or None for one draft forward per token. (Trees get the guess as one more branch
        from the decoder.)"""
        self.target_seconds: Callable[[int], float] | None = None
        """Set by `configure` from the engine's measured forwards: seconds of a target forward over t tokens. With
        it (and `prompt_lookup`), a step whose guess promises more tokens per second than drafting
        proposes the guess alone and skips the draft model (`guess_beats_draft`)."""
        self.guess_rate = AcceptanceRate()
        self.draft_rate = AcceptanceRate()
        """Per-request acceptance of lookup guesses (judged by the target, or by the draft while it drafts)
        and of the draft model's tokens."""
        self._guessed = False
        """The last proposal was a bare guess (not drafted by the draft model)."""
        self._proposed = 0
        """Tokens of the last chain proposal."""
        self.forwards = 0
        """Draft forwards so far (tests: what the guesses saved)."""
        self.tree_width = tree_width
        """Nodes kept per tree level (1 = a chain, 0 = node budget / depth)."""
        self.capabilities = Capabilities(tree_width=tree_width, catch_up=True)
        self.tree_value: TreeValue | None = None
        """Set by `configure` (fed by `on_verified`): how much of a grown tree gets verified."""
        self.tree_branching = tree_branching
        """Candidates (top-b draft tokens) expanded per kept node."""
        self._cache: KVCache | None = None
        self._cache_len = max_len + MAX_TREE_NODES
        self.num_cached = 0
        """Tokens of the sequence whose K/V are valid in our cache (slots [0, num_cached))."""
        self._cost = 0.0
        self._catch_up_cost = 0.0

    def configure(self, cost: CostModel) -> None:
        self.target_seconds = cost.target_forward_seconds
        if self.capabilities.trees:
            self.tree_value = TreeValue(cost.target_forward_seconds)

    def begin(self, seq: SequenceView) -> None:
        # Nothing is fed yet: the first `propose` catches the cache up on the prompt (and anything
        # generated meanwhile) in one forward. A request that never drafts (k = 0 under load, or a
        # useless drafter) never pays for the draft's prefill.
        if self._cache is not None:
            self._cache.reset()
        self.num_cached = 0
        self.guess_rate.reset()
        self.draft_rate.reset()
        if self.tree_value is not None:
            self.tree_value.reset()

    @property
    def cache(self) -> KVCache:
        """Allocated on first use: a request that never drafts (served under load) never pays for it."""
        if self._cache is None:
            self._cache = self.model.new_cache(1, self._cache_len)
        return self._cache

    def _feed(self, ids: list[int]) -> torch.Tensor | None:
        """Append ids to our cache; returns fp32 logits of the last one [V]."""
        rows = self._feed_rows(ids, last_only=True)
        return None if rows is None else rows[0]

    def _feed_rows(self, ids: list[int], last_only: bool = False) -> torch.Tensor | None:
        """Append ids to our cache; returns fp32 logits after each of them [len(ids), V] (or [1, V])."""
        if not ids:
            return None
        dev = self.model.device
        start = self.num_cached
        tokens = self._in_rows(torch.tensor([ids], device=dev))
        positions = torch.arange(start, start + len(ids), device=dev).unsqueeze(0)
        hidden = self.model(tokens, positions, self.cache)  # [1, len(ids), H]
        self.forwards += 1
        self.num_cached = start + len(ids)
        self.cache.set_length(0, self.num_cached)
        return self._logits(hidden[0, -1:] if last_only else hidden[0])

    def _in_rows(self, tokens: torch.Tensor) -> torch.Tensor:
        return draft_input_ids(self.model, self.vocab, tokens)

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return draft_logits(self.model, self.vocab, hidden)

    def propose(self, seq: SequenceView, k: int, node_budget: int | None = None) -> Draft:
        self._guessed, self._proposed = False, 0
        if k <= 0:
            return Draft()
        if self.tree_width != 1:
            return self._propose_tree(seq, k, DEFAULT_NODE_BUDGET if node_budget is None else node_budget)
        if self.prompt_lookup and self.target_seconds is not None and seq.output_counts is None:
            guess = ngram_match(seq.token_ids, *self.prompt_lookup, k)
            if guess_beats_draft(len(guess), k, self.guess_rate.value, self.draft_rate.value, self.target_seconds,
                                 self.step_cost_hint()):
                # A point mass, as from the n-gram proposer; the draft catches up on it when next used.
                self._guessed, self._proposed = True, len(guess)
                return Draft(guess)
        draft = self._propose_chain(seq, k)
        self._proposed = len(draft)
        return draft

    def _propose_chain(self, seq: SequenceView, k: int) -> Draft:
        """k tokens drafted one after another, as the draft model alone would draft them (`ChainDraft`;
        with `prompt_lookup`, a forward checks a guess of the next tokens too)."""
        logits = self._feed(seq.token_ids[self.num_cached :])  # [V] after the newest token
        if logits is None:  # cannot happen once begin() ran; keeps the invariant explicit
            raise RuntimeError("draft cache is ahead of the sequence")
        chain = ChainDraft(seq, k, self.prompt_lookup, self.guess_rate)
        try:
            chain.pick(logits)
            while not chain.done:
                start = self.num_cached
                rows = self._feed_rows(chain.next_feed())  # [1 + len(guess), V]; row i follows fed[: i + 1]
                assert rows is not None
                # Only the fed tokens the draft agreed with stay; rows past them were a wrong guess.
                self.num_cached = start + chain.take(rows)
                self.cache.set_length(0, self.num_cached)
        finally:
            chain.rollback()  # the grammar's matcher stands where it stood, even if drafting failed
        return chain.draft()

    def on_verified(self, seq: SequenceView, num_accepted: int, own_accepted: int | None = None) -> None:
        if self.tree_value is not None and own_accepted is not None:
            self.tree_value.observe(own_accepted)
        if self._proposed:  # a chain (trees and k = 0 steps say nothing about either rate)
            (self.guess_rate if self._guessed else self.draft_rate).observe(self._proposed, num_accepted)
            self._proposed = 0  # observed once: a later step the row does not draft in is not this proposal's
        # Our cache holds the prefix plus the first k-1 draft tokens; keep only accepted ones.
        valid = len(seq.token_ids) - 1  # everything but the step's new token is final
        self.num_cached = min(self.num_cached, valid)
        if self._cache is not None:
            self._cache.set_length(0, self.num_cached)

    def step_cost_hint(self) -> float:
        """Seconds of one single-token draft forward, measured once (median of 5 after a warm-up); the
        warm-up feed also gives the per-token cost of a catch-up forward."""
        if self._cost == 0.0:
            self.cache.reset()
            self.num_cached = 0
            room = self.cache.max_len  # a short context leaves less room for the warm-up and the samples
            warm = max(0, min(64, room - 6))
            self._feed([1] * warm)  # a realistic cache, if it fits (and first-call overheads paid)
            self.cache.reset()
            self.num_cached = 0
            t0 = time.perf_counter()
            self._feed([1] * warm)
            self._catch_up_cost = (time.perf_counter() - t0) / max(1, warm)
            samples = []
            for _ in range(max(1, min(6, room - self.num_cached))):
                t0 = time.perf_counter()
                self._feed([1])
                samples.append(time.perf_counter() - t0)
            self._cost = statistics.median(samples[1:] or samples)
            self.cache.reset()
            self.num_cached = 0
        return self._cost

    def catch_up_tokens(self, seq: SequenceView) -> int:
        """Tokens the next propose must feed before drafting (the prompt on the first draft, everything
        since the last draft after a pause); 0 when only the newest token is new."""
        lag = len(seq.token_ids) - self.num_cached
        return 0 if lag <= 1 else lag

    def catch_up_token_seconds(self) -> float:
        """Seconds per token of a catch-up forward (measured with step_cost_hint)."""
        self.step_cost_hint()
        return self._catch_up_cost

    def _propose_tree(self, seq: SequenceView, depth: int, node_budget: int) -> Draft:
        """A tree grown by `grow_tree`, each level fed through the draft with tree attention. Children are
        deterministic and distinct: point masses to the verifier."""
        logits = self._feed(seq.token_ids[self.num_cached :])
        assert logits is not None
        base = self.num_cached  # prefix in our cache; the pending (root) token is at slot base - 1
        dev = self.model.device

        def expand(level: TreeLevel) -> torch.Tensor:
            hidden = self.model(self._in_rows(level.tokens[None].to(dev)), level.positions[None].to(dev), self.cache,
                                slots=level.slots[None].to(dev), attn_mask=level.mask[None].to(dev))
            return self._logits(hidden[0])  # [m, V]

        width = level_width(self.tree_width, node_budget, depth)
        draft = grow_tree(logits, depth, width, self.tree_branching, base, expand,
                          select=node_selector(self.tree_value, self.tree_width, lambda: depth * self.step_cost_hint(),
                                              node_budget))
        # Tree entries past the prefix are scratch: the next propose re-feeds what was accepted.
        self.cache.set_length(0, base)
        return draft
