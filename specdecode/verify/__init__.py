"""Verification of draft tokens against the target: rejection sampling and the greedy fast path."""

from specdecode.verify.rejection import verify_chain, verify_greedy

__all__ = ["verify_chain", "verify_greedy"]
