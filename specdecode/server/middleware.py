"""Pure ASGI middlewares of the server, run before FastAPI parses anything: the API key and the body limit."""

from __future__ import annotations

import hmac
import json

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.server.errors import error_body
from specdecode.server.metrics import ServerMetrics

MAX_BODY_BYTES = 1 << 20


async def _send_json(send: Send, status: int, body: dict, headers: list[tuple[bytes, bytes]] | None = None) -> None:
    raw = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode()),
                            *(headers or [])]})
    await send({"type": "http.response.body", "body": raw})


class AuthMiddleware:
    """With an API key, every path but /health needs `Authorization: Bearer KEY` (else a 401)."""

    def __init__(self, app: ASGIApp, api_key: str, metrics: ServerMetrics) -> None:
        self.app, self.expected, self.metrics = app, f"Bearer {api_key}".encode(), metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] == "/health":
            return await self.app(scope, receive, send)
        given = dict(scope["headers"]).get(b"authorization", b"")
        if not hmac.compare_digest(given, self.expected):
            self.metrics.request_errors.labels(code="401").inc()
            message = "missing or invalid API key: send 'Authorization: Bearer <key>'"
            return await _send_json(send, 401, error_body(401, message, None, "invalid_api_key"),
                                    [(b"www-authenticate", b"Bearer")])
        return await self.app(scope, receive, send)


DRAIN_LIMIT = 16 << 20
"""A refused body declared at most this large is read (and dropped) before the 413: closing a connection with
unread data resets it, and the client may then see "connection reset" instead of the 413 (nginx's lingering
close does the same)."""


async def _drain(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


class BodyLimitMiddleware:
    """Refuse request bodies over `limit` bytes with a 413, by Content-Length or while reading a chunked body.

    POST bodies are read as JSON whatever their Content-Type (the API takes nothing else).
    """

    def __init__(self, app: ASGIApp, limit: int, metrics: ServerMetrics) -> None:
        self.app, self.limit, self.metrics = app, limit, metrics

    async def _refuse(self, send: Send) -> None:
        self.metrics.request_errors.labels(code="413").inc()
        await _send_json(send, 413, error_body(413, f"request body larger than {self.limit} bytes", None,
                                               "request_too_large"), [(b"connection", b"close")])

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        if scope["method"] == "POST":
            # Every body this API takes is JSON: read it as JSON whatever the Content-Type says (curl -d sends
            # application/x-www-form-urlencoded), so the client gets a useful error about its content.
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-type"]
            scope = {**scope, "headers": [*headers, (b"content-type", b"application/json")]}
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            try:
                declared = int(length)
            except ValueError:
                declared = self.limit + 1
            if declared > self.limit:
                if declared <= DRAIN_LIMIT:
                    await _drain(receive)
                return await self._refuse(send)
            return await self.app(scope, receive, send)
        # No length given (chunked): read the body here, up to the limit, and replay it.
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # disconnected
            chunks.append(message.get("body", b""))
            size += len(chunks[-1])
            if size > self.limit:
                return await self._refuse(send)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)
