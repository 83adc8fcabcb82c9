"""Draft trees as data: parent lists -> attention mask, depths/positions, retrieve indices (pure)."""

from specdecode.tree.buffers import MAX_TREE_NODES, TreeBuffers, build_tree, tree_from_paths, validate_parents

__all__ = ["MAX_TREE_NODES", "TreeBuffers", "build_tree", "tree_from_paths", "validate_parents"]
