"""Golden values for tree buffers built from hand-made trees."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specdecode.tree import TreeBuffers, build_tree, tree_from_paths

T, F = True, False


def _check(buffers: TreeBuffers, mask: list[list[bool]], depth: list[int], retrieve: list[list[int]]) -> None:
    assert buffers.attn_mask.dtype == torch.bool
    assert buffers.depth.dtype == buffers.parent.dtype == buffers.retrieve_indices.dtype == torch.long
    assert buffers.attn_mask.tolist() == mask
    assert buffers.depth.tolist() == depth
    assert buffers.retrieve_indices.tolist() == retrieve


def test_chain_is_lower_triangular() -> None:
    buffers = build_tree([-1, 0, 1, 2])
    _check(buffers, torch.ones(4, 4, dtype=torch.bool).tril().tolist(), [0, 1, 2, 3], [[0, 1, 2, 3]])
    assert buffers.parent.tolist() == [-1, 0, 1, 2]
    assert buffers.children == ((1,), (2,), (3,), ())
    assert buffers.leaves == (3,)
    assert buffers.max_depth == 3


def test_star() -> None:
    buffers = build_tree([-1, 0, 0, 0])
    mask = [
        [T, F, F, F],
        [T, T, F, F],
        [T, F, T, F],
        [T, F, F, T],
    ]
    _check(buffers, mask, [0, 1, 1, 1], [[0, 1], [0, 2], [0, 3]])
    assert buffers.children == ((1, 2, 3), (), (), ())
    assert buffers.positions(prefix_len=10).tolist() == [9, 10, 10, 10]


def test_two_level_tree() -> None:
    #        0
    #      /   \
    #     1     2
    #    / \    |
    #   3   4   5
    buffers = build_tree([-1, 0, 0, 1, 1, 2])
    mask = [
        [T, F, F, F, F, F],
        [T, T, F, F, F, F],
        [T, F, T, F, F, F],
        [T, T, F, T, F, F],
        [T, T, F, F, T, F],
        [T, F, T, F, F, T],
    ]
    _check(buffers, mask, [0, 1, 1, 2, 2, 2], [[0, 1, 3], [0, 1, 4], [0, 2, 5]])
    assert buffers.parent.tolist() == [-1, 0, 0, 1, 1, 2]
    assert buffers.children == ((1, 2), (3, 4), (5,), (), (), ())
    assert buffers.num_nodes == 6
    assert buffers.positions(prefix_len=7).tolist() == [6, 7, 7, 8, 8, 8]
    assert buffers.path_to(0) == [0]
    assert buffers.path_to(4) == [0, 1, 4]
    assert buffers.path_to(5) == [0, 2, 5]


def test_unequal_depths_are_padded() -> None:
    # Leaf 2 at depth 1, leaf 4 at depth 3; rows follow leaf index order.
    buffers = build_tree([-1, 0, 0, 1, 3])
    _check(
        buffers,
        [
            [T, F, F, F, F],
            [T, T, F, F, F],
            [T, F, T, F, F],
            [T, T, F, T, F],
            [T, T, F, T, T],
        ],
        [0, 1, 1, 2, 3],
        [[0, 2, -1, -1], [0, 1, 3, 4]],
    )


def test_root_only() -> None:
    buffers = build_tree([-1])
    _check(buffers, [[T]], [0], [[0]])
    assert buffers.children == ((),)
    assert buffers.leaves == (0,)


def test_to_device_keeps_values() -> None:
    buffers = build_tree([-1, 0, 0, 1]).to("cpu")
    assert buffers.retrieve_indices.tolist() == [[0, 2, -1], [0, 1, 3]]


@pytest.mark.parametrize(
    ("parents", "message"),
    [
        ([], "empty"),
        ([0, 0], "root"),
        ([-1, -1], "one root"),
        ([-1, 0, -1], "one root"),
        ([-1, 1], "topological"),  # self-parent
        ([-1, 2, 0], "topological"),  # parent after child
        ([-1, 0, -3], "topological"),
    ],
)
def test_bad_parents_are_rejected(parents: list[int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_tree(parents)


def test_path_to_out_of_range() -> None:
    with pytest.raises(IndexError):
        build_tree([-1, 0]).path_to(2)


def test_tree_from_paths_medusa_style() -> None:
    # Paths of child ranks; [1, 0] shares node [1] with [1]; [2, 1] creates its missing prefix [2].
    parents, labels = tree_from_paths([[0], [1], [0, 0], [1, 0], [2, 1]])
    assert parents == [-1, 0, 0, 1, 2, 0, 5]
    assert labels == [-1, 0, 1, 0, 0, 2, 1]
    buffers = build_tree(parents)
    assert buffers.depth.tolist() == [0, 1, 1, 2, 2, 1, 2]


@st.composite
def parent_lists(draw: st.DrawFn) -> list[int]:
    n = draw(st.integers(1, 12))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


@settings(max_examples=100, deadline=None)
@given(parent_lists())
def test_buffers_are_consistent(parents: list[int]) -> None:
    buffers = build_tree(parents)
    n = len(parents)
    mask = buffers.attn_mask
    for i in range(n):
        path = buffers.path_to(i)
        assert path[0] == 0 and path[-1] == i
        assert len(path) == int(buffers.depth[i]) + 1
        # A node sees exactly its ancestors and itself.
        assert mask[i].nonzero().flatten().tolist() == sorted(path)
    # One retrieve row per leaf, each the padded path to it.
    for row, leaf in zip(buffers.retrieve_indices.tolist(), buffers.leaves, strict=True):
        assert [x for x in row if x >= 0] == buffers.path_to(leaf)
        assert row[len(buffers.path_to(leaf)) :] == [-1] * (len(row) - len(buffers.path_to(leaf)))
    # Children lists invert the parent list.
    assert sorted(c for kids in buffers.children for c in kids) == list(range(1, n))
    for i, kids in enumerate(buffers.children):
        assert all(parents[c] == i for c in kids)
