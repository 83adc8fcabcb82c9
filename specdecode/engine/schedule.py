"""The draft length and tree size of every row of a batch step, from one cost model of the batch forward.

Each row first picks its own best draft length (its `AdaptiveK`, or a fixed k). The batch then shares one
target forward over every row's nodes, padded to the widest row, so what a row's draft costs depends on
the others: a tree row may verify as many nodes as the forward over all rows affords almost for free
(`tree_node_budget` at this many rows), which falls toward a chain as rows join; and one batch-wide cap on
the adaptive rows' k maximises the batch's expected tokens per second, which falls toward k = 0 under
load. Rows are padded to the widest, so a step whose forward is wider than a token a row anyway lets every
row's waiting probe run with it (unless its drafter must catch up first). A row that proposes its prompt-lookup
guess alone is priced as a chain without draft steps or catch-up.
A k fixed by the server or by the request is honoured.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from specdecode.cost_model import CostModel, tree_node_budget
from specdecode.engine.adaptive import AdaptiveK
from specdecode.engine.lookup_guess import RowGuess, expected_tokens
from specdecode.proposers.tree_growth import DEFAULT_NODE_BUDGET, priced_nodes
from specdecode.tree import MAX_TREE_NODES

if TYPE_CHECKING:
    from specdecode.engine.running import Running
    from specdecode.proposers.base import BatchProposer

CATCH_UP_HORIZON_TOKENS = 256
"""The expected output tokens of a request before any request has finished (about a chat answer's length;
max_tokens is only a bound, EOS often comes first): a draft's catch-up is amortised over them
(`RequestHistory.expected_length` learns the real ones)."""


@dataclass
class PreferredDraft:
    """The draft length one row would choose alone, and what its drafting costs the batch."""

    k: int
    policy: AdaptiveK | None
    """None for a row that never drafts."""
    catch_up_seconds: float = 0.0
    """Seconds of the drafter's catch-up this step would pay (spread over the steps it serves)."""
    guess_rate: float | None = None
    """The row proposes a prompt-lookup guess of k tokens alone, each kept at this rate given the ones before
    (the drafter does not run: no draft steps, no catch-up, a chain of k nodes); None: its drafter drafts."""

    def capped(self, rows: int) -> bool:
        """Capped by a batch of `rows` rows: not a fixed k, nor a free probe (one token that keeps a lone row's
        estimate alive). In a batch a probe widens every row's forward (rows are padded to the widest), and a
        probe whose drafter must first catch up (a draft model that has not drafted for a while feeds it all)
        pays that catch-up: either is capped like any k, so the batch pays for a probe only where it pays back;
        but a probe deferred for an interval per row is due and runs, so no row stays at k = 0 unprobed."""
        if self.policy is None or self.policy.fixed_k is not None or self.policy.probe_due(rows):
            return False
        return not self.policy.probing or self.catch_up_seconds > 0 or rows > 1

    def expected_tokens(self, k: int) -> float:
        if self.guess_rate is not None:
            return expected_tokens(self.guess_rate, k)
        return self.policy.tracker.expected_tokens(k) if self.policy is not None else 1.0


@dataclass
class Lengths:
    ks: list[int]
    """Draft length (tree depth) per row."""
    node_budget: int
    """Tree nodes each tree row may verify."""
    guesses: list[RowGuess] = field(default_factory=list)
    """Per row: its prompt-lookup guess this step, and the part it proposes alone (cut to its k)."""


def catch_up_share(tokens: int, token_seconds: float, tokens_left: int, tokens_per_step: float, dip: bool,
                   expected_length: float = CATCH_UP_HORIZON_TOKENS) -> float:
    """Seconds a row's draft catch-up (feeding `tokens` its proposer has not seen since it last drafted: the
    prompt at first) charges this step: spread over the steps left to the request (the fewer of the
    `tokens_left` max_tokens allows and the request's `expected_length`) at its expected tokens per step, as it
    is paid once and the drafter then keeps up while the row drafts. In a dip below the recent batch size
    (requests finishing just before the next ones arrive) a row pays it all now, since the load that made it
    pause returns. Only the choice of k depends on it, never the output."""
    if tokens == 0:
        return 0.0
    horizon = 1.0 if dip else max(1.0, min(expected_length, tokens_left) / tokens_per_step)
    return tokens * token_seconds / horizon


def node_budget(cost: CostModel | None, k_max: int, rows: int) -> int:
    """Tree nodes per row when `rows` rows share the forward (DEFAULT_NODE_BUDGET before any measurement)."""
    if cost is None:
        return DEFAULT_NODE_BUDGET
    return min(MAX_TREE_NODES, tree_node_budget(cost, k_max, rows))


def row_catch_up(proposer: BatchProposer | None, cost: CostModel | None, row: Running, k: int, dip: bool,
                 expected_length: float) -> float:
    """What the row's draft catch-up charges a step at k (`catch_up_share`; 0 for a drafter that never catches up)."""
    if k <= 0 or proposer is None or cost is None or not proposer.capabilities.catch_up:
        return 0.0
    assert row.policy is not None
    seq = row.seq
    return catch_up_share(proposer.catch_up_tokens(row.key, seq.view()), cost.catch_up_token_seconds,
                          seq.params.max_tokens - seq.num_output, row.policy.tracker.expected_tokens(k), dip,
                          expected_length)


def choose_lengths(preferred: list[PreferredDraft], cost: CostModel | None, tree_width: int, k_max: int) -> Lengths:
    """Every row's k and the per-row node budget, maximising the batch's expected tokens per second."""
    ks = [w.k for w in preferred]
    budget = node_budget(cost, k_max, len(preferred))
    if cost is None or not any(ks):
        return Lengths(ks, budget)

    def nodes(w: PreferredDraft, k: int) -> int:
        return priced_nodes(tree_width, budget, k) if tree_width != 1 and w.guess_rate is None else k

    free = [not w.capped(len(preferred)) for w in preferred]
    best_cap, best_rate = 0, -1.0
    for cap in range(max(ks) + 1):
        capped = [w.k if f else min(w.k, cap) for w, f in zip(preferred, free, strict=True)]
        pairs = list(zip(preferred, capped, strict=True))
        tokens = sum(w.expected_tokens(k) for w, k in pairs)
        seconds = cost.target_forward_seconds(len(preferred) * (max(nodes(w, k) for w, k in pairs) + 1))
        seconds += sum(k for w, k in pairs if w.guess_rate is None) * cost.draft_step_seconds
        seconds += sum(w.catch_up_seconds for w, k in pairs if k > 0)
        rate = tokens / seconds
        if rate > best_rate * (1 + 1e-9):
            best_cap, best_rate = cap, rate
    ks = [w.k if f else min(w.k, best_cap) for w, f in zip(preferred, free, strict=True)]
    if max(ks) > 0:  # the forward is wider than a token a row anyway: the probes waiting for a turn ride along
        ks = [max(k, 1) if w.policy is not None and w.policy.probing and not w.catch_up_seconds else k
              for w, k in zip(preferred, ks, strict=True)]
    return Lengths(ks, budget)


def row_cost(cost: CostModel, tree_width: int, k_max: int) -> CostModel:
    """The cost model a request alone sizes its own k with: a tree row verifies, at each depth, the nodes a
    lone row's budget affords."""
    if tree_width == 1:
        return cost
    budget = node_budget(cost, k_max, 1)
    return cost.with_tree_nodes(
        tuple(min(MAX_TREE_NODES, priced_nodes(tree_width, budget, k)) for k in range(1, k_max + 1)))
