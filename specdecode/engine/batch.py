"""The engine under its former name: `BatchEngine` is `specdecode.engine.core.Engine`."""

from specdecode.engine.core import Engine as BatchEngine
from specdecode.engine.core import QueueFullError

__all__ = ["BatchEngine", "QueueFullError"]
