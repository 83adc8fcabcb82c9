"""Tree buffers: everything a tree verify pass needs to know about the tree's shape, as tensors.

A draft tree is data (docs/design.md). It is described by a parent list in topological order:
node 0 is the root, i.e. the pending token (the last output token, not yet fed to the target), with
parents[0] == -1; every other node's parent has a smaller index than the node itself. `build_tree`
turns that list into the attention mask, depths (hence rope positions), parent and retrieve indices.
Everything here is pure and cheap (n is a few dozen nodes), so it runs on the CPU; move the result
with `TreeBuffers.to(device)`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

MAX_TREE_NODES = 64
"""Cache headroom reserved past max_len for one step's tree (and cap on a proposer's tree size)."""


@dataclass(frozen=True, eq=False)  # eq=False: tensor fields have no boolean ==
class TreeBuffers:
    """The shape of one draft tree of n nodes (node 0 = root = pending token), as tensors."""

    attn_mask: torch.Tensor
    """bool [n, n]: node i attends to node j iff j is i or an ancestor of i (the tree part of the mask;
    every node also attends to the whole prefix, which the caller adds)."""
    depth: torch.Tensor
    """long [n]: distance from the root (root 0). Rope positions are `positions(prefix_len)`."""
    parent: torch.Tensor
    """long [n]: parent index of each node, -1 for the root."""
    retrieve_indices: torch.Tensor
    """long [num_leaves, max_depth+1]: row j = node indices of the root-to-leaf path of the j-th leaf
    (leaves in index order), padded with -1 on the right."""
    children: tuple[tuple[int, ...], ...]
    """children[i] = indices of node i's children in insertion (index) order; the order in which the
    verifier tries siblings."""

    @property
    def num_nodes(self) -> int:
        return int(self.parent.shape[0])

    @property
    def max_depth(self) -> int:
        return int(self.retrieve_indices.shape[1]) - 1

    @property
    def leaves(self) -> tuple[int, ...]:
        """Indices of the nodes without children, in index order (one per retrieve_indices row)."""
        return tuple(i for i, kids in enumerate(self.children) if not kids)

    def positions(self, prefix_len: int) -> torch.Tensor:
        """Rope positions [n] when the root (pending token) sits at position prefix_len - 1, i.e. the
        sequence so far, pending token included, has prefix_len tokens. Siblings share a position."""
        return self.depth + (prefix_len - 1)  # [n]

    def path_to(self, node: int) -> list[int]:
        """Node indices from the root to `node`, both included."""
        if not 0 <= node < self.num_nodes:
            raise IndexError(f"node {node} is out of range for a tree of {self.num_nodes} nodes")
        parents = self.parent.tolist()
        path = [node]
        while parents[path[-1]] >= 0:
            path.append(parents[path[-1]])
        return path[::-1]

    def to(self, device: torch.device | str) -> TreeBuffers:
        """The same buffers with every tensor on `device`."""
        return TreeBuffers(
            attn_mask=self.attn_mask.to(device),
            depth=self.depth.to(device),
            parent=self.parent.to(device),
            retrieve_indices=self.retrieve_indices.to(device),
            children=self.children,
        )


def validate_parents(parents: Sequence[int]) -> None:
    """Raise ValueError unless `parents` is a single-rooted tree in topological order."""
    if len(parents) == 0:
        raise ValueError("a tree needs at least the root node; got an empty parent list")
    if parents[0] != -1:
        raise ValueError(f"node 0 must be the root (parent -1), got parent {parents[0]}")
    for i, p in enumerate(parents[1:], start=1):
        if p == -1:
            raise ValueError(f"node {i} has parent -1: a tree has exactly one root (node 0)")
        if not 0 <= p < i:
            # Parents before children keeps every per-node pass a single forward sweep.
            raise ValueError(f"node {i} has parent {p}; parents must be in topological order (0 <= parent < {i})")


def build_tree(parents: Sequence[int]) -> TreeBuffers:
    """Build the buffers of the tree given by `parents` (parents[0] == -1, parents[i] < i otherwise)."""
    parents = [int(p) for p in parents]
    validate_parents(parents)
    n = len(parents)

    children: list[list[int]] = [[] for _ in range(n)]
    depth = [0] * n
    for i in range(1, n):
        children[parents[i]].append(i)
        depth[i] = depth[parents[i]] + 1  # parent already done: topological order

    # Row i = row of its parent plus itself; one sweep since parents come first.
    attn_mask = torch.zeros(n, n, dtype=torch.bool)  # [n, n]
    for i in range(n):
        if parents[i] >= 0:
            attn_mask[i] = attn_mask[parents[i]]
        attn_mask[i, i] = True

    max_depth = max(depth)
    leaves = [i for i in range(n) if not children[i]]
    retrieve = torch.full((len(leaves), max_depth + 1), -1, dtype=torch.long)  # [num_leaves, max_depth+1]
    for row, leaf in enumerate(leaves):
        node = leaf
        while node >= 0:
            retrieve[row, depth[node]] = node
            node = parents[node]

    return TreeBuffers(
        attn_mask=attn_mask,
        depth=torch.tensor(depth, dtype=torch.long),
        parent=torch.tensor(parents, dtype=torch.long),
        retrieve_indices=retrieve,
        children=tuple(tuple(kids) for kids in children),
    )


def tree_from_paths(paths: Sequence[Sequence[int]]) -> tuple[list[int], list[int]]:
    """Parent list of the trie of `paths`, e.g. Medusa-style static trees given as top-k rank paths.

    Each path lists labels (tokens, or child ranks) from a child of the root down to a node; shared
    prefixes become shared nodes and missing prefixes are created. Nodes are numbered in the order
    their prefix first appears, which is topological. Returns (parents [n], labels [n]) with
    labels[0] = -1 for the root.
    """
    parents, labels = [-1], [-1]
    index: dict[tuple[int, ...], int] = {(): 0}
    for path in paths:
        prefix: tuple[int, ...] = ()
        for label in path:
            child = (*prefix, int(label))
            if child not in index:
                index[child] = len(parents)
                parents.append(index[prefix])
                labels.append(int(label))
            prefix = child
    return parents, labels
