"""Structured outputs: what a request constrains its output to (`StructuredOutputsParams`, no dependency)
and the grammar engine that turns it into per-token masks (`matcher.py`, llguidance, imported on use)."""

from specdecode.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
