"""OpenAI-compatible HTTP server: `specdecode serve` (docs/serving.md).

`build_app(llm, ...)` returns the FastAPI app; `AsyncEngine` runs a BatchEngine on a background thread.
Attributes load lazily, so `specdecode --help` (which builds the serve parser) never imports FastAPI.
"""

from __future__ import annotations

from typing import Any

_EXPORTS = {
    "build_app": "specdecode.server.app",
    "AsyncEngine": "specdecode.server.async_engine",
    "RequestStream": "specdecode.server.async_engine",
    "Update": "specdecode.server.async_engine",
    "ServerMetrics": "specdecode.server.metrics",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'specdecode.server' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(_EXPORTS[name]), name)
