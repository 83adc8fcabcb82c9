"""Growing a draft tree level by level, shared by every tree proposer (draft model, EAGLE, Medusa).

Each kept node expands its top-b tokens; of all candidates the `width` with the highest cumulative
draft log-probability are kept (EAGLE-2's rule), up to MAX_TREE_NODES in all. The proposer supplies
`expand`, which turns a level's new nodes into their logits (one forward with tree attention for
model-like proposers, a table lookup for Medusa).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from specdecode.proposers.base import Draft
from specdecode.tree import MAX_TREE_NODES

DEFAULT_NODE_BUDGET = 16
"""Tree nodes per step before the engine has measured what the target's forward affords."""


MIN_DYNAMIC_WIDTH = 2
"""A dynamic tree grows at least this many nodes a level, even where the budget spread over the depth is one: the
nodes it verifies are chosen from what was grown (`select`), and a chain leaves nothing to choose from. Two, not
more: a second candidate per level holds most of what alternatives add, and every node grown costs the drafter
work at its level (BENCHMARKS.md, "Trees vs chains", measures both)."""


def level_width(tree_width: int, node_budget: int, depth: int) -> int:
    """Nodes kept per level: the configured width, or (0 = dynamic) the node budget spread over depth, at
    least MIN_DYNAMIC_WIDTH."""
    if tree_width > 0:
        return tree_width
    return max(MIN_DYNAMIC_WIDTH, min(16, node_budget // max(1, depth)))


def priced_nodes(tree_width: int, node_budget: int, depth: int) -> int:
    """Nodes the cost model charges a tree of `depth` levels for. A chain verifies what it drafts; a tree is cut
    to the nodes worth their verification (`TreeValue`), which is about the node budget the target's forward
    affords (where its cost starts to climb), at least one path of `depth` nodes. Charging every grown node
    would price a width-2 tree of depth 5 (10 nodes grown, about 5 verified) at twice the forward it runs, and
    the draft-length policy would stop short of the depths where long guesses pay."""
    grown = level_width(tree_width, node_budget, depth) * depth  # a chain grows `depth`: charged all of it
    return min(grown, max(depth, node_budget))


@dataclass
class TreeLevel:
    """The nodes added at one level, ready for a forward over the proposer's own cache."""

    level: int
    """Depth of these nodes minus one (0 = children of the root)."""
    nodes: list[int]
    """Tree indices (1-based; 0 is the root = the pending token)."""
    parents: list[int]
    tokens: torch.Tensor  # [m]
    positions: torch.Tensor  # [m] rope positions: base - 1 + depth
    slots: torch.Tensor  # [m] cache slots: base - 1 + tree index
    mask: torch.Tensor  # [m, base + num_nodes] bool: the prefix and each node's ancestors


class TreeGrower:
    """One tree grown level by level, driven from outside: `next_level` adds a level's nodes and returns them
    for a forward (None when the tree is done), `expanded` takes that forward's logits at those nodes. A batch
    proposer drives one grower per row and runs every row's level in one forward.

    `base` = entries of the proposer's cache before the tree; the root sits at slot base - 1. `select`, given
    the nodes' cumulative draft probabilities in descending order, returns how many to verify; the tree is
    cut to those (see `prune_to_best`)."""

    def __init__(
        self,
        root_logits: torch.Tensor,  # [V] logits for the first draft position
        depth: int,
        width: int,
        branching: int,
        base: int,
        token_map: torch.Tensor | None = None,  # [V] logit column -> token id (a head's draft vocabulary)
        select: Callable[[list[float]], int] | None = None,
    ) -> None:
        self.depth, self.width, self.branching, self.base = depth, width, branching, base
        self.token_map, self.select = token_map, select
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.scores: list[float] = []
        self.ancestors: dict[int, list[int]] = {0: []}  # tree index -> tree indices of its path (root excluded)
        self.frontier = [(0, 0.0, root_logits)]  # (tree index, cumulative log-prob, logits at that node)
        self.level = 0
        self.pending: list[tuple[int, float]] = []  # (tree index, score) of the nodes awaiting `expanded`

    def next_level(self) -> TreeLevel | None:
        """Add the next level's nodes; the level to run through the proposer, or None when the tree is done."""
        if self.level >= self.depth or not self.frontier:
            return None
        level, tokens, parents = self.level, self.tokens, self.parents
        self.level += 1
        cands: list[tuple[float, int, int]] = []
        for idx, score, lg in self.frontier:
            top = torch.log_softmax(lg.float(), -1).topk(self.branching)
            toks = (self.token_map[top.indices] if self.token_map is not None else top.indices).tolist()
            cands += [(score + lp, idx, t) for lp, t in zip(top.values.tolist(), toks, strict=True)
                      if lp > float("-inf")]
        self.frontier = []
        room = MAX_TREE_NODES - len(tokens)
        cands = sorted(cands, key=lambda c: -c[0])[: min(self.width, room)]
        if not cands:
            return None
        new: list[tuple[int, float]] = []
        for score, parent, tok in cands:
            tokens.append(tok)
            parents.append(parent)
            self.scores.append(score)
            idx = len(tokens)
            self.ancestors[idx] = [*self.ancestors[parent], idx]
            new.append((idx, score))
        if level + 1 == self.depth:
            return None
        base = self.base
        mask = torch.zeros(len(new), base + len(tokens), dtype=torch.bool)
        mask[:, :base] = True
        for row, (idx, _) in enumerate(new):
            mask[row, [base - 1 + a for a in self.ancestors[idx]]] = True
        nodes = [idx for idx, _ in new]
        self.pending = new
        return TreeLevel(
            level=level,
            nodes=nodes,
            parents=[parents[idx - 1] for idx in nodes],
            tokens=torch.tensor([tokens[idx - 1] for idx in nodes]),
            positions=torch.tensor([base - 1 + len(self.ancestors[idx]) for idx in nodes]),
            slots=torch.tensor([base - 1 + idx for idx in nodes]),
            mask=mask,
        )

    def expanded(self, node_logits: torch.Tensor) -> None:
        """The logits [m, V] at the nodes of the level `next_level` returned."""
        self.frontier = [(idx, score, node_logits[row]) for row, (idx, score) in enumerate(self.pending)]
        self.pending = []

    def draft(self) -> Draft:
        tokens, parents = self.tokens, self.parents
        if self.select is not None and len(tokens) > 1:
            tokens, parents = prune_to_best(tokens, parents, self.scores, self.select)
        return Draft(list(tokens), None, list(parents))


def grow_tree(
    root_logits: torch.Tensor,  # [V] logits for the first draft position
    depth: int,
    width: int,
    branching: int,
    base: int,
    expand: Callable[[TreeLevel], torch.Tensor],  # -> [m, V] logits at the new nodes
    token_map: torch.Tensor | None = None,  # [V] logit column -> token id (a head's draft vocabulary)
    select: Callable[[list[float]], int] | None = None,
) -> Draft:
    """One row's tree (see `TreeGrower`), each level expanded by `expand` (one forward with tree attention for
    model-like proposers, a table lookup for Medusa)."""
    grower = TreeGrower(root_logits, depth, width, branching, base, token_map, select)
    while (level := grower.next_level()) is not None:
        grower.expanded(expand(level))
    return grower.draft()


def prune_to_best(tokens: list[int], parents: list[int], scores: list[float],
                  select: Callable[[list[float]], int]) -> tuple[list[int], list[int]]:
    """Keep the n nodes of highest cumulative log-probability, n = select(their probabilities).

    A child never scores above its parent (log-probabilities add up to <= 0) and ties go to the
    earlier node, so every prefix of that order is a subtree. Kept nodes stay in their original
    (level) order; parents are renumbered."""
    order = sorted(range(len(tokens)), key=lambda i: (-scores[i], i))
    n = max(1, min(len(order), select([math.exp(scores[i]) for i in order])))
    kept = sorted(order[:n])
    new_index = {0: 0} | {old + 1: new for new, old in enumerate(kept, 1)}
    return [tokens[i] for i in kept], [new_index[parents[i]] for i in kept]


def graft_chain(tokens: list[int], parents: list[int], chain: list[int],
                max_nodes: int = MAX_TREE_NODES) -> tuple[list[int], list[int]]:
    """Add `chain` (tokens following the root) to a tree as a path from the root.

    The path shares the nodes the tree already has (a child with the same token under the same parent);
    the rest are appended after the existing nodes, so parents stay before their children and siblings
    stay distinct. The chain is cut when the tree holds `max_nodes` nodes."""
    tokens, parents = list(tokens), list(parents)
    child = {(p, t): i for i, (p, t) in enumerate(zip(parents, tokens, strict=True), 1)}  # (parent, token) -> node
    node = 0
    for tok in chain:
        nxt = child.get((node, tok))
        if nxt is None:
            if len(tokens) >= max_nodes:
                break
            tokens.append(tok)
            parents.append(node)
            nxt = child[(node, tok)] = len(tokens)
        node = nxt
    return tokens, parents

