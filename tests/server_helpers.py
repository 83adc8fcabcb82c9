"""A real uvicorn server on loopback, in a background thread, for the server tests."""

from __future__ import annotations

import re
import socket
import threading
import time
from typing import Any

import httpx
import uvicorn
from fastapi import FastAPI

API_KEY = "sk-test-key"


class LiveServer:
    """Serve `app` on 127.0.0.1 at a free port (the socket is bound before uvicorn starts: no race)."""

    def __init__(self, app: FastAPI, api_key: str | None = API_KEY) -> None:
        self.app = app
        self.api_key = api_key
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=2)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def start(self, timeout: float = 60.0) -> LiveServer:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if httpx.get(self.base_url + "/health", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if not self.thread.is_alive():
                raise RuntimeError("the server thread died during start-up")
            time.sleep(0.05)
        raise TimeoutError("the server did not become healthy")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.sock.close()

    def openai(self, **kw: Any) -> Any:
        from openai import OpenAI

        return OpenAI(base_url=self.base_url + "/v1", api_key=self.api_key or "none", max_retries=0, timeout=60, **kw)

    def metrics(self) -> dict[str, float]:
        """The Prometheus text of /metrics as {'name{labels}': value}."""
        text = httpx.get(self.base_url + "/metrics", headers=self.headers, timeout=10).text
        return parse_prometheus(text)

    def post(self, path: str, **kw: Any) -> httpx.Response:
        headers = {**self.headers, **kw.pop("headers", {})}
        return httpx.post(self.base_url + path, headers=headers, timeout=kw.pop("timeout", 60), **kw)


def free_port() -> int:
    """A port free on 127.0.0.1 now (for a server in a subprocess, which binds it itself)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def parse_prometheus(text: str) -> dict[str, float]:
    out = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = re.match(r"^(\S+?(?:\{.*\})?)\s+(\S+)$", line)
        if m:
            out[m.group(1)] = float(m.group(2))
    return out


def sse_events(lines: Any) -> list[Any]:
    """Parse `data: ...` lines of an SSE stream into JSON objects (and the final '[DONE]')."""
    import json

    events = []
    for line in lines:
        if line.startswith("data: "):
            payload = line[len("data: "):]
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
