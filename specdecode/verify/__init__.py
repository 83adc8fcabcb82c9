"""Verification of draft trees against the target (a chain is a tree with one branch): rejection sampling and the
greedy fast path."""

from specdecode.verify.tree import verify_tree, verify_tree_greedy

__all__ = ["verify_tree", "verify_tree_greedy"]
