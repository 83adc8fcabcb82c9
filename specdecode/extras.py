"""The message for a missing optional dependency group (`pip install 'specdecode[serve]'` ...)."""

from __future__ import annotations


def missing_extra(extra: str, exc: ImportError) -> str:
    """What to install when an import of the `extra` group failed."""
    name = exc.name or str(exc)
    return f"this needs the [{extra}] extra ({name} is not installed): pip install 'specdecode[{extra}]'"
