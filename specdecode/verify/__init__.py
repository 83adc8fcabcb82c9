"""Verification of draft tokens against the target: rejection sampling and the greedy fast paths."""

from specdecode.verify.rejection import verify_chain, verify_greedy
from specdecode.verify.tree import verify_tree, verify_tree_greedy

__all__ = ["verify_chain", "verify_greedy", "verify_tree", "verify_tree_greedy"]
