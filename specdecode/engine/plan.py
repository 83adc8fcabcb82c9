"""The plan of one batch step: what the target's forward reads and writes, for every row at once.

Every row's draft is a tree whose node 0 is the row's pending token (a chain is a tree with one branch);
the plan lays the rows side by side, padded to the widest: tokens, rope positions, cache slots (one per
node, right after the row's prefix), the attention mask (the prefix plus each node's ancestors) and which
of the forward's outputs are real nodes (the only ones whose logits are computed).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.proposers.base import Draft
from specdecode.tree import TreeBuffers, build_tree


@dataclass
class RowTree:
    """One row's draft as a tree of n nodes: node 0 is the pending token."""

    tokens: list[int]
    parents: list[int]
    """parents[0] = -1; parents before their children."""
    draft_probs: torch.Tensor | None
    """[n, V]: row v = the distribution node v's children were sampled from; None for point masses."""
    drafted: int
    """Draft nodes the proposer itself offered (a grafted lookup branch follows them)."""
    forced: int = 0
    """Point-mass nodes the grammar forced at the end of a chain (the last `forced` nodes)."""

    @classmethod
    def of(cls, pending: int, draft: Draft, drafted: int | None = None) -> RowTree:
        k = len(draft)
        parents = [-1, *(draft.parents if draft.parents is not None else range(k))]
        probs = None
        if draft.probs is not None:  # a sampled chain: node v's child came from probs[v]; the leaf has none
            probs = torch.cat([draft.probs, draft.probs.new_zeros(1, draft.probs.shape[-1])])
        return cls([pending, *draft.tokens], parents, probs, k if drafted is None else drafted)

    @property
    def num_drafted(self) -> int:
        return len(self.tokens) - 1

    @property
    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self.parents) - 1))


@dataclass
class StepPlan:
    tokens: torch.Tensor  # [B, T] (rows padded with their pending token)
    positions: torch.Tensor  # [B, T] rope positions: the root's position + depth
    slots: torch.Tensor  # [B, T] cache slots: the root's slot + node index
    mask: torch.Tensor | None
    """[B, T, S] bool over cache slots; None when every row is a chain, whose tree mask is the causal mask
    over its slots (the forward builds that one, as for plain decoding)."""
    trees: list[TreeBuffers]
    starts: list[int]
    """Each row's root slot: the number of tokens its cache holds."""
    logits_index: torch.Tensor
    """[N] indices into the flattened [B * T] outputs of the real nodes, row after row."""
    offsets: list[int]
    """Row i's nodes are logits rows offsets[i] : offsets[i + 1]."""

    @property
    def rows(self) -> int:
        return len(self.trees)


def build_plan(rows: list[RowTree], starts: list[int]) -> StepPlan:
    """The step plan of rows whose roots sit at cache slots `starts`."""
    trees = [build_tree(r.parents) for r in rows]
    width = max(len(r.tokens) for r in rows)
    b = len(rows)
    tokens = torch.zeros(b, width, dtype=torch.long)
    positions = torch.zeros(b, width, dtype=torch.long)
    slots = torch.zeros(b, width, dtype=torch.long)
    chains = all(r.is_chain for r in rows)
    mask = None if chains else torch.zeros(b, width, max(starts) + width, dtype=torch.bool)
    index, offsets = [], [0]
    for i, (r, tree, start) in enumerate(zip(rows, trees, starts, strict=True)):
        n = len(r.tokens)
        tokens[i, :n] = torch.tensor(r.tokens)
        tokens[i, n:] = r.tokens[0]  # padding: past the real nodes, read by no real node
        slots[i] = torch.arange(start, start + width)
        positions[i, :n] = tree.positions(start + 1)
        positions[i, n:] = torch.arange(start + n, start + width) if chains else start
        if mask is not None:
            mask[i, :, :start] = True  # every node sees the prefix ...
            mask[i, :n, start : start + n] = tree.attn_mask  # ... and its ancestors
            mask[i, torch.arange(n, width), torch.arange(start + n, start + width)] = True  # padding: itself
        index.extend(range(i * width, i * width + n))
        offsets.append(offsets[-1] + n)
    return StepPlan(tokens, positions, slots, mask, trees, list(starts), torch.tensor(index), offsets)
