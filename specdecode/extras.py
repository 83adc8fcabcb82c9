"""The message for a missing optional dependency group (`pip install -e '.[serve]'` ...)."""

from __future__ import annotations


def missing_extra(extra: str, exc: ImportError) -> str:
    """What to install when an import of the `extra` group failed: from a checkout until a package index holds
    specdecode, by name where one does."""
    name = exc.name or str(exc)
    return (f"this needs the [{extra}] extra ({name} is not installed): pip install -e '.[{extra}]' in a "
            f"specdecode checkout (or pip install 'specdecode[{extra}]' where a package index holds specdecode)")
