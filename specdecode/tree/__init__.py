"""Draft trees as data: parent lists -> attention mask, depths/positions, retrieve indices (pure)."""

from specdecode.tree.buffers import TreeBuffers, build_tree, tree_from_paths, validate_parents

__all__ = ["TreeBuffers", "build_tree", "tree_from_paths", "validate_parents"]
