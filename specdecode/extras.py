"""The optional dependency groups (`pip install 'specdecode[serve]'` ...) and the message for a missing one."""

from __future__ import annotations

EXTRAS = {
    "serve": ("fastapi", "uvicorn", "pydantic", "prometheus_client"),
    "bench": ("matplotlib",),
}


def missing_extra(extra: str, exc: ImportError) -> str:
    """What to install when an import of the `extra` group failed."""
    name = exc.name or str(exc)
    return f"this needs the [{extra}] extra ({name} is not installed): pip install 'specdecode[{extra}]'"
