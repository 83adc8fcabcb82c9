"""The server's requests as a whole: how many are in flight, and the drain before the process exits (new requests
refused with a 503, those in flight given time to finish, what is left failed so that every response ends)."""

from __future__ import annotations

import asyncio
import logging

from fastapi.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from specdecode.server.async_engine import AsyncEngine
from specdecode.server.errors import error_body
from specdecode.server.metrics import ServerMetrics

logger = logging.getLogger("specdecode.server")

UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})
"""Probes: answered while draining, and never what a drain waits for."""
FLUSH_S = 5.0
"""After the drain timeout fails what is left, the time its error responses get to reach their clients."""
POLL_S = 0.05


class Lifecycle:
    """Requests in flight (counted by `DrainMiddleware`) and whether the server drains."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    async def drain(self, timeout: float, engine: AsyncEngine) -> bool:
        """Refuse new requests and wait up to `timeout` seconds for those in flight to finish; then fail what is
        left (each gets its error: a 500 body or an error event) and wait for those answers to go out. True when
        every request finished in time."""
        self.draining = True
        logger.info("draining: %d request(s) in flight, waiting up to %g s", self.in_flight, timeout)
        if await self._settled(timeout):
            return True
        logger.warning("drain timeout: failing the %d request(s) still in flight", self.in_flight)
        await asyncio.to_thread(engine.stop, FLUSH_S)
        await self._settled(FLUSH_S)
        return False

    async def _settled(self, timeout: float) -> bool:
        loop = asyncio.get_running_loop()
        end = loop.time() + timeout
        while self.in_flight and loop.time() < end:
            await asyncio.sleep(POLL_S)
        return not self.in_flight


class DrainMiddleware:
    """Counts the requests in flight; while draining, answers new ones with a 503 (probes excepted)."""

    def __init__(self, app: ASGIApp, lifecycle: Lifecycle, metrics: ServerMetrics) -> None:
        self.app, self.lifecycle, self.metrics = app, lifecycle, metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in UNCOUNTED_PATHS:
            return await self.app(scope, receive, send)
        if self.lifecycle.draining:
            self.metrics.request_errors.labels(code="503").inc()
            body = error_body(503, "the server is shutting down; send the request to another server or retry later",
                              None, "server_shutting_down")
            response = JSONResponse(body, status_code=503, headers={"Retry-After": "1", "Connection": "close"})
            return await response(scope, receive, send)
        self.lifecycle.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.lifecycle.in_flight -= 1
