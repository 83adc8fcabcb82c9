"""The `specdecode` logger: library modules log to children of it (`logging.getLogger(__name__)`) and install
no handler; the command line installs one while a command runs (`cli_logging`).

Long steps (GGUF conversion, kernel compilation, start-up cost measurement, model loading) log one line with
their duration through `timed_step`: at INFO when they take `LONG_STEP_SECONDS` or more, or when the step
only ever runs once (a conversion, a compilation); at DEBUG otherwise, so a quick run stays quiet.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from tqdm.auto import tqdm

LOGGER_NAME = "specdecode"
LONG_STEP_SECONDS = 1.0

logger = logging.getLogger(LOGGER_NAME)


@contextmanager
def timed_step(log: logging.Logger, what: str, *, always: bool = False) -> Iterator[dict[str, str]]:
    """Log "<what> in <seconds> s[, <detail>]" when the block ends without an exception; the block may set
    `detail` in the yielded dict to add numbers it measured."""
    info: dict[str, str] = {}
    started = time.perf_counter()
    yield info
    seconds = time.perf_counter() - started
    level = logging.INFO if always or seconds >= LONG_STEP_SECONDS else logging.DEBUG
    detail = f", {info['detail']}" if info.get("detail") else ""
    log.log(level, "%s in %.2f s%s", what, seconds, detail)


def progress_bar(**kwargs: Any) -> tqdm:
    """A live tqdm bar on a terminal's stderr for a step of more than a few seconds, erased when it ends (the
    step's timed log line follows); none when stderr is not a terminal or the `specdecode` logger is set above
    INFO (`specdecode -q`)."""
    shown = sys.stderr.isatty() and logger.level <= logging.INFO
    return tqdm(file=sys.stderr, mininterval=0.5, leave=False, disable=not shown, **kwargs)


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is at the time of each record (a test's capture included)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)

    @property  # type: ignore[override]
    def stream(self):  # noqa: ANN201 - a text stream
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:  # noqa: ANN001
        pass


class _CliFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        if record.exc_info:
            message += "\n" + self.formatException(record.exc_info)
        if record.levelno >= logging.WARNING:
            return f"specdecode: {record.levelname.lower()}: {message}"
        return f"specdecode: {message}"


def verbosity_level(verbose: int, quiet: bool) -> int:
    """-q: warnings only; default: INFO (the long steps); -v: DEBUG (every step with its time)."""
    if quiet:
        return logging.WARNING
    return logging.DEBUG if verbose > 0 else logging.INFO


@contextmanager
def cli_logging(level: int) -> Iterator[None]:
    """A stderr handler on the `specdecode` logger at `level` while a command runs (removed afterwards, so
    in-process callers such as tests keep their own logging set-up)."""
    handler = _StderrHandler()
    handler.setFormatter(_CliFormatter())
    handler.setLevel(level)
    previous = logger.level
    logger.addHandler(handler)
    logger.setLevel(level)
    try:
        yield
    finally:
        logger.removeHandler(handler)
        logger.setLevel(previous)
