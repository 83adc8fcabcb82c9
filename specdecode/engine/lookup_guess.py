"""The lookup-or-draft choice: each step a row's lookup guess (its suffix source: its own text and earlier answers)
is either proposed alone or grafted onto its drafter's tree.

A draft model or a head drafts well but costs a forward per token or tree level; prompt lookup costs nothing but
offers a guess only where the suffix occurred before. A row whose guess alone promises more expected tokens per
second than its drafter's step proposes the guess (no drafter forward: copied text then costs no draft forward,
and a drafter too slow to pay still speeds up the copying); every other tree row gets the guess as one more
branch, verified in the same target forward. The row's suffix is matched once per step (`RowGuess`), and the
guess read at each length asked. A guess's expected tokens use one acceptance rate (the row's `guess_rate`, an
`AcceptanceTracker` that pools its positions); costs come from the start-up measurement, never from a clock, so a
seeded request drafts the same way on every run. Where the proposer is itself a lookup (n-gram, suffix), there is
no guess beside it; its drafts are made in the schedule instead (`lookup_drafts`).
"""

from __future__ import annotations

from collections.abc import Callable

from specdecode.cost_model import CostModel
from specdecode.engine.row_faults import propose_rows
from specdecode.engine.running import Running
from specdecode.proposers.base import BatchProposer, Draft, ProposeRow
from specdecode.proposers.suffix_source import SuffixSource
from specdecode.proposers.suffix_trie import ContinuationTrie
from specdecode.proposers.tree_growth import graft_chain


class RowGuess:
    """One row's lookup guess in one step. The suffix source is read on first use only; each length asked (alone:
    the row's reach; as a branch: its k) reads its own chain from the longest length asked so far."""

    def __init__(self, tokens: list[int], source: SuffixSource | None, tenant: str | None = None,
                 shared: bool = True) -> None:
        self._tokens, self._source, self._tenant, self._shared = tokens, source, tenant, shared
        self._trie: ContinuationTrie | None = None
        self._depth = 0
        self.alone: list[int] = []
        """The guess the row proposes alone this step, cut to its k ([]: its drafter drafts, if k > 0)."""

    def tokens(self, n: int) -> list[int]:
        """Up to n guessed tokens ([]: lookup off, or no earlier occurrence of the suffix)."""
        if self._source is None or n <= 0:
            return []
        if self._trie is None or n > self._depth:
            self._trie, self._depth = self._source.trie(self._tokens, self._tenant, n, self._shared), n
        return self._trie.chain(n)


def lookup_drafts(proposer: BatchProposer, rows: list[Running], ks: list[int], vocab: int) -> list[int]:
    """A lookup proposer's drafts (n-gram, suffix), drafted in the schedule since they cost nothing: each row's k
    becomes the nodes its lookup found, so the batch-wide cap prices real nodes and not a k a row cannot fill (a
    row padded to the widest for nothing costs the whole batch). The drafts are kept for the step
    (`Running.drafted`)."""
    asks = [ProposeRow(r.key, r.seq.view(), k, k) for r, k in zip(rows, ks, strict=True) if k > 0]
    drafts = iter(propose_rows(proposer, asks, {r.key: r.seq for r in rows}, vocab))
    for r, k in zip(rows, ks, strict=True):
        r.drafted = next(drafts) if k > 0 else None
    return [len(r.drafted) if r.drafted is not None else 0 for r in rows]


def guess_alone(row: Running, guess: RowGuess, k: int, allowed: int, node_budget: int, catch_up: float,
                cost: CostModel | None) -> list[int]:
    """The guess the row proposes alone (no drafter forward, a forward over the guess only) where that promises
    more tokens per second than its drafter's step at k (its catch-up included; at k = 0, a plain step); []
    where the drafter pays more, or where there is no drafter cost to save (the n-gram proposer is the lookup
    itself). The guess reaches as far as the copy goes on, up to the row's cap `allowed` and the nodes its tree
    would verify (a fixed k: k), and is cut at the length with the most tokens per second. `cost` is the row's
    own cost model."""
    policy, seq = row.policy, row.seq
    if policy is None or cost is None or cost.draft_step_seconds <= 0 or seq.params.has_penalties:
        return []
    reach = k if policy.fixed_k is not None else max(k, node_budget)  # a fixed k is the request's own depth
    tokens = guess.tokens(min(allowed, reach))
    if not tokens:
        return []
    rate, forward = row.guess_rate.alpha(0), cost.target_forward_seconds
    n = best_guess_len(len(tokens), rate, forward)
    draft_tokens, draft_seconds = policy.tracker.expected_tokens(k), cost.step_seconds(k) + catch_up
    return tokens[:n] if guess_beats(n, rate, draft_tokens, draft_seconds, forward) else []


def with_lookup_branch(draft: Draft, guess: RowGuess, k: int) -> Draft:
    """A tree draft plus the row's guess of k tokens as one more branch: verification checks both in the same
    target forward (copied text is accepted through the guess, the rest through the drafter's tree). Chains
    and drafts without a guess come back unchanged."""
    if not draft.is_tree:
        return draft
    branch = guess.tokens(k)
    if not branch:
        return draft
    assert draft.parents is not None
    tokens, parents = graft_chain(draft.tokens, draft.parents, branch)
    return Draft(tokens, None, parents)  # the drafter's nodes keep their indices; the branch comes after


def expected_tokens(rate: float, n: int) -> float:
    """Tokens a step emits on average with a guess of n tokens each kept at `rate` given the ones before: the
    kept run plus the target's own (recovered or bonus) token."""
    return 1.0 + sum(rate**i for i in range(1, n + 1))


def guess_beats(guess_len: int, rate: float, draft_tokens: float, draft_seconds: float,
                target_seconds: Callable[[int], float]) -> bool:
    """True when verifying the guess alone yields at least the tokens per second of the drafter's step, which
    emits `draft_tokens` on average in `draft_seconds` (a chain's or a tree's, its drafting included)."""
    if guess_len <= 0:
        return False
    return expected_tokens(rate, guess_len) / target_seconds(guess_len + 1) >= draft_tokens / draft_seconds


def best_guess_len(guess_len: int, rate: float, target_seconds: Callable[[int], float]) -> int:
    """The prefix of a guess (1..guess_len tokens) whose verification alone yields the most expected tokens per
    second: a longer guess costs a wider forward, worth it while its tail is likely to be kept."""
    return max(range(1, guess_len + 1), key=lambda n: expected_tokens(rate, n) / target_seconds(n + 1))
