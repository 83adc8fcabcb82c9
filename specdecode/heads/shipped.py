"""Heads that ship with the package, by target alias: `{"method": "eagle"}` with no "model" uses them."""

from __future__ import annotations

from pathlib import Path

SHIPPED_DIR = Path(__file__).parent / "shipped"
SHIPPED = {
    ("qwen2.5-coder-1.5b-instruct", "eagle"): "qwen2.5-coder-1.5b-instruct-eagle",
}
"""(target alias, head kind) -> directory under SHIPPED_DIR. Reproduce with the command in its README."""


def shipped_head(target: str, kind: str) -> Path | None:
    name = SHIPPED.get((Path(str(target)).name.removesuffix(".gguf"), kind))
    if name is None or not (SHIPPED_DIR / name / "config.json").exists():
        return None
    return SHIPPED_DIR / name


def shipped_heads(target: str) -> dict[str, str]:
    """Kind ("eagle", "medusa") -> the directory of the head shipped for `target`, for the kinds that have one."""
    return {kind: str(p) for kind in ("eagle", "medusa") if (p := shipped_head(target, kind)) is not None}
