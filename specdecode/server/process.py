"""The server as a process (`specdecode serve`): uvicorn, a drain on SIGTERM before a clean exit (code 0), and a
non-zero exit when the engine dies, so that a supervisor (systemd, Kubernetes, Ray) restarts it."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import threading
from types import FrameType

import uvicorn
from fastapi import FastAPI
from uvicorn.config import STARTUP_FAILURE

from specdecode.server.state import ServerState

logger = logging.getLogger("specdecode.server")

SHUTDOWN_GRACE_S = 5
"""uvicorn's wait for open connections once it stops (after the drain there are none, or only failed ones)."""
HARD_EXIT_S = 30.0
"""After the engine died: leave this long after asking the server to stop, even if its shutdown hangs."""


class ProcessExit:
    """The engine's `on_death` hook in a process: remember the exit code and stop the server, which then returns
    it (a timer leaves with it should the shutdown hang)."""

    def __init__(self) -> None:
        self.code = 0
        self.server: uvicorn.Server | None = None

    def __call__(self, code: int) -> None:
        self.code = code
        if self.server is not None:
            self.server.should_exit = True
        timer = threading.Timer(HARD_EXIT_S, os._exit, (code,))
        timer.daemon = True
        timer.start()


class DrainingServer(uvicorn.Server):
    """uvicorn, except that SIGTERM drains first (`Lifecycle.drain`: /health and new requests 503, those in flight
    finish within `drain_timeout_s`), then shuts down and returns instead of re-raising the signal (exit code 0).
    SIGINT (Ctrl+C) keeps uvicorn's immediate shutdown."""

    def __init__(self, config: uvicorn.Config, state: ServerState, drain_timeout_s: float) -> None:
        super().__init__(config)
        self.state, self.drain_timeout_s = state, drain_timeout_s
        self._drain_asked = False
        self._drain: asyncio.Task[None] | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if sig == signal.SIGTERM and not self.should_exit:
            self._drain_asked = True  # a signal handler: the next tick starts the drain on the event loop
            return
        super().handle_exit(sig, frame)

    async def on_tick(self, counter: int) -> bool:
        if self._drain_asked and self._drain is None:
            self._drain = asyncio.ensure_future(self._drain_then_exit())
        return await super().on_tick(counter)

    async def _drain_then_exit(self) -> None:
        try:
            await self.state.lifecycle.drain(self.drain_timeout_s, self.state.engine)
        finally:
            self.should_exit = True


def run_server(app: FastAPI, host: str, port: int, log_level: str, drain_timeout_s: float,
               process_exit: ProcessExit, limit_concurrency: int | None = None) -> int:
    """Serve `app` until SIGTERM (drained: 0), SIGINT, or the engine's death (`process_exit.code`, 1); the exit
    code. Beyond `limit_concurrency` connections or requests in progress (None: no limit), uvicorn answers 503."""
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=SHUTDOWN_GRACE_S,
                            limit_concurrency=limit_concurrency)
    server = DrainingServer(config, app.state.server, drain_timeout_s)
    process_exit.server = server
    server.run()
    if not server.started:  # it could not bind, or the app's start-up failed: uvicorn has said why
        return STARTUP_FAILURE
    if process_exit.code:
        logger.error("the engine died; exiting with code %d", process_exit.code)
    return process_exit.code
