"""The Ray Serve application: an ingress deployment (the OpenAI-compatible HTTP API, `@serve.ingress`
with a FastAPI app) in front of an engine deployment of N replicas (each one `build_app(llm)` of the
plain server, run in-process).

A request goes: HTTP proxy -> `Ingress` (auth, body limit, routing key, retries, merged /metrics) -> one
`EngineReplica` through a DeploymentHandle whose `PrefixAffinityRouter` picks the replica -> the
replica runs the request through the very app `specdecode serve` runs (same validation, errors and
SSE) and streams its ASGI messages back. The ingress holds a response back until it shows the client
some output, so a replica that dies before that is invisible: the request is retried once on another
replica. A replica that dies after that ends the stream with an OpenAI-shaped error event.

Back-pressure: each replica takes `max_num_seqs + max_waiting` requests; beyond that the ingress's handle
holds `max_queued_requests` more and refuses the rest (Ray Serve's BackPressureError), which the ingress
answers with a 429 and Retry-After, as one server answers a full queue.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from ray import serve
from ray.serve.config import RequestRouterConfig
from ray.serve.exceptions import BackPressureError
from ray.serve.handle import DeploymentHandle

from specdecode import __version__
from specdecode.cluster.config import ClusterConfig
from specdecode.cluster.merge import merge_metrics
from specdecode.cluster.registry import ROUTER_REGISTRY, live_replicas
from specdecode.cluster.routing import carries_output, routing_key
from specdecode.server.middleware import BodyLimitMiddleware

logger = logging.getLogger("specdecode.cluster")

ENGINE_DEPLOYMENT = "SpecdecodeEngine"
INGRESS_DEPLOYMENT = "SpecdecodeIngress"
REPLICA_HEADER = "x-specdecode-replica"
ROUTER_PATH = "specdecode.cluster.router.PrefixAffinityRouter"
"""By import path: each process that holds a handle imports the router itself."""
_HOP_HEADERS = {b"connection", b"keep-alive", b"transfer-encoding", b"upgrade", b"te", b"trailer",
                b"proxy-authorization", b"proxy-authenticate"}
RETRY_AFTER_S = 1
INGRESS_QUEUE = 1024
"""Requests the HTTP proxy holds for the ingress. The ingress only forwards (its own bound, 100,000 in flight, is
never the bottleneck), so only a burst waits here for the proxy to hand it over: a generous bound, since Ray
Serve counts a request as queued until it is assigned, even while the replica has room."""


def _error(status: int, message: str, code: str, err_type: str = "service_unavailable_error",
           headers: dict[str, str] | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": err_type, "param": None, "code": code}}
    return JSONResponse(body, status_code=status, headers=headers)


# ---- the engine replica ------------------------------------------------------------------------------


class EngineReplica:
    """One engine: the plain server's app (`build_app`), driven in-process, one ASGI call per request."""

    def __init__(self, config: dict[str, Any]) -> None:
        import torch

        from specdecode import LLM
        from specdecode.server.app import build_app

        cfg = ClusterConfig(**config)
        torch.set_num_threads(cfg.replica_threads)
        llm = LLM(cfg.model, dtype=cfg.dtype, device=cfg.device, max_model_len=cfg.max_model_len,
                  speculative_config=cfg.speculative_config, seed=cfg.seed, quantization=cfg.quantization,
                  max_num_seqs=cfg.max_num_seqs, enable_prefix_caching=cfg.enable_prefix_caching,
                  prefix_cache_gb=cfg.prefix_cache_gb, max_num_batched_tokens=cfg.max_num_batched_tokens)
        # No API key here: the ingress checks it; replicas are reachable only through Ray.
        self.app = build_app(llm, max_num_seqs=cfg.max_num_seqs, max_waiting=cfg.max_waiting,
                             served_model_name=cfg.served_model_name or cfg.model,
                             model_aliases=(cfg.model,), api_key=None, max_body_bytes=cfg.max_body_bytes,
                             default_max_tokens=cfg.default_max_tokens)
        self.engine = self.app.state.engine
        self.engine.start()  # what the app's lifespan does under uvicorn
        self.replica_id = serve.get_replica_context().replica_id.unique_id
        self.pid = os.getpid()
        logger.info("engine replica %s (pid %d) serves %s", self.replica_id, self.pid, cfg.model)

    async def _asgi(self, request: dict[str, Any]) -> AsyncIterator[dict[str, Any]]:
        """Run one HTTP request through the app; yield its ASGI messages. Cancelling the consumer cancels
        the app's task, which aborts the request in the engine (as a client disconnect would)."""
        body: bytes = request.get("body", b"")
        path: str = request["path"]
        scope = {
            "type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": request["method"],
            "scheme": "http", "path": path, "raw_path": path.encode(), "root_path": "",
            "query_string": request.get("query_string", b""), "headers": request.get("headers", []),
            "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {},
        }
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            await asyncio.Event().wait()  # no disconnect until the caller goes away (then we are cancelled)
            raise AssertionError("unreachable")

        out: asyncio.Queue[dict[str, Any] | None] = asyncio.Queue()

        async def send(message: dict[str, Any]) -> None:
            out.put_nowait(message)

        async def run() -> None:
            try:
                await self.app(scope, receive, send)
            finally:
                out.put_nowait(None)

        task = asyncio.ensure_future(run())
        try:
            while True:
                message = await out.get()
                if message is None:
                    break
                yield message
                if message["type"] == "http.response.body" and not message.get("more_body", False):
                    break
        finally:
            if not task.done():
                task.cancel()

    async def handle(self, request: dict[str, Any], **routing: Any) -> AsyncIterator[dict[str, Any]]:
        """The ASGI messages of `request`, after a first message naming this replica."""
        yield {"type": "replica", "replica": self.replica_id, "pid": self.pid}
        async for message in self._asgi(request):
            yield message

    async def _get(self, path: str) -> tuple[int, bytes]:
        status, parts = 500, []
        async for m in self._asgi({"method": "GET", "path": path, "headers": []}):
            if m["type"] == "http.response.start":
                status = m["status"]
            elif m["type"] == "http.response.body":
                parts.append(m.get("body", b""))
        return status, b"".join(parts)

    async def metrics_text(self, **routing: Any) -> dict[str, Any]:
        return {"replica": self.replica_id, "text": self.app.state.metrics.render().decode()}

    async def info(self, **routing: Any) -> dict[str, Any]:
        status, _ = await self._get("/health")
        return {"replica": self.replica_id, "pid": self.pid, "healthy": status == 200}

    async def check_health(self) -> None:
        """Ray Serve's health check: the server's own /health (the engine thread is running)."""
        status, body = await self._get("/health")
        if status != 200:
            raise RuntimeError(f"engine replica {self.replica_id} is unhealthy: {body.decode(errors='replace')}")

    def __del__(self) -> None:
        engine = getattr(self, "engine", None)
        if engine is not None:
            engine.stop(timeout=5)


# ---- the ingress ---------------------------------------------------------------------------------------


class ReplicaLost(Exception):
    def __init__(self, replica: str | None, cause: BaseException | str) -> None:
        super().__init__(f"replica {replica or '(unknown)'} failed: {cause}")
        self.replica = replica


@dataclass
class _Opened:
    """A response whose start is known: what the replica sent until it committed, and the rest to come."""

    gen: Any
    replica: str | None
    start: dict[str, Any]
    chunks: list[bytes] = field(default_factory=list)
    done: bool = False


class _ErrorCounter:
    """The `request_errors` counter that the server's middlewares (BodyLimitMiddleware) expect of its metrics."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.request_errors = Counter("specdecode_cluster_request_errors",
                                      "Requests the ingress refused or failed itself, by HTTP status code.",
                                      ["code"], registry=registry)


class _AuthCheck:
    def __init__(self, api_key: str | None) -> None:
        self.expected = f"Bearer {api_key}".encode() if api_key else None

    def ok(self, request: Request) -> bool:
        if self.expected is None:
            return True
        return hmac.compare_digest(request.headers.get("authorization", "").encode(), self.expected)


@serve.ingress()
class Ingress:
    """The OpenAI-compatible endpoint of the cluster."""

    def __init__(self, engine: DeploymentHandle, config: dict[str, Any]) -> None:
        self.cfg = ClusterConfig(**config)
        self.engine = engine
        self.registry = CollectorRegistry(auto_describe=True)
        self.errors = _ErrorCounter(self.registry)
        self.retries = Counter("specdecode_cluster_retries", "Requests retried on another replica after "
                               "theirs failed before showing output.", registry=self.registry)
        self.stream_failures = Counter("specdecode_cluster_stream_failures", "Streams ended by an error event: "
                                       "their replica failed after they showed output.", registry=self.registry)
        self.replica_gauge = Gauge("specdecode_cluster_replicas", "Engine replicas the ingress can route to.",
                                   registry=self.registry)
        self.auth = _AuthCheck(self.cfg.api_key)

    # ---- helpers -----------------------------------------------------------------------------------

    async def replica_ids(self) -> list[str]:
        ids = live_replicas(ENGINE_DEPLOYMENT)
        if not ids:  # the handle's router starts with the first call through it
            try:
                await asyncio.wait_for(self.engine.info.remote(), 30)
            except Exception:  # noqa: BLE001 - no replica answers: report none
                return []
            ids = live_replicas(ENGINE_DEPLOYMENT)
        return sorted(ids)

    async def _each(self, method: str, timeout: float = 10.0) -> dict[str, Any]:
        """`method` of every routable replica, one call after the other: Ray Serve routes the calls of one
        request by its request id, so concurrent calls from one request would wait on each other."""
        ids = await self.replica_ids()
        self.replica_gauge.set(len(ids))
        out: dict[str, Any] = {}
        for rid in ids:
            try:
                out[rid] = await asyncio.wait_for(getattr(self.engine, method).remote(target=rid), timeout)
            except Exception as exc:  # noqa: BLE001 - a replica that does not answer is left out
                logger.warning("replica %s did not answer %s: %s", rid, method, exc)
        return out

    async def _open(self, request: dict[str, Any], key: str | None, avoid: str | None) -> _Opened:
        """Send `request` to a replica; read until its response commits (shows output, or ends)."""
        gen = self.engine.options(stream=True).handle.remote(request, route_key=key, avoid=avoid)
        opened = _Opened(gen, None, {})
        try:
            async for message in gen:
                kind = message["type"]
                if kind == "replica":
                    opened.replica = message["replica"]
                elif kind == "http.response.start":
                    opened.start = message
                elif kind == "http.response.body":
                    chunk = message.get("body", b"")
                    opened.chunks.append(chunk)
                    opened.done = not message.get("more_body", False)
                    if opened.done or (chunk and carries_output(chunk)):
                        return opened
            raise ReplicaLost(opened.replica, "its response ended without a body")
        except (ReplicaLost, BackPressureError, asyncio.CancelledError):  # lost, no room, or the client left
            gen.cancel()
            raise
        except Exception as exc:  # noqa: BLE001 - the replica died, was unreachable, or its call failed
            gen.cancel()
            raise ReplicaLost(opened.replica, f"{type(exc).__name__}: {exc}") from exc

    async def forward(self, request: Request) -> Response:
        if not self.auth.ok(request):
            self.errors.request_errors.labels(code="401").inc()
            return _error(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", "invalid_api_key",
                          "authentication_error", {"WWW-Authenticate": "Bearer"})
        body = await request.body()  # at most --max-body-bytes: BodyLimitMiddleware read it first
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None  # the replica answers the 400
        key = routing_key(parsed, request.headers, self.cfg.route_prefix_chars)
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP_HEADERS]
        call = {"method": request.method, "path": request.url.path, "query_string": request.url.query.encode(),
                "headers": headers, "body": body}
        try:
            try:
                opened = await self._open(call, key, None)
            except ReplicaLost as first:
                logger.warning("retrying a request on another replica: %s", first)
                self.retries.inc()
                try:
                    opened = await self._open(call, key, first.replica)
                except ReplicaLost as second:
                    logger.warning("the retry failed too: %s", second)
                    self.errors.request_errors.labels(code="503").inc()
                    return _error(503, f"the engine replica serving this request failed before answering, and so "
                                       f"did the retry on another replica ({second}); retry the request",
                                  "replica_unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})
        except BackPressureError as exc:  # every replica is full and so is the queue for them
            self.errors.request_errors.labels(code="429").inc()
            return _error(429, f"the cluster is busy ({exc}); retry later", "rate_limit_exceeded",
                          "rate_limit_error", {"Retry-After": str(RETRY_AFTER_S)})
        status = opened.start.get("status", 500)
        out_headers = {k.decode("latin-1"): v.decode("latin-1") for k, v in opened.start.get("headers", [])}
        out_headers[REPLICA_HEADER] = opened.replica or ""
        if opened.done:
            return Response(b"".join(opened.chunks), status_code=status, headers=out_headers)
        out_headers.pop("content-length", None)
        media_type = out_headers.pop("content-type", None)
        return StreamingResponse(self._rest(opened), status_code=status, headers=out_headers, media_type=media_type)

    async def _rest(self, opened: _Opened) -> AsyncIterator[bytes]:
        finished = False
        try:
            for chunk in opened.chunks:
                yield chunk
            try:
                async for message in opened.gen:
                    if message["type"] != "http.response.body":
                        continue
                    yield message.get("body", b"")
                    if not message.get("more_body", False):
                        finished = True
                        return
                raise RuntimeError("the stream ended early")
            except Exception as exc:  # noqa: BLE001 - the replica died mid-stream: say so, then end the stream
                logger.warning("replica %s failed mid-stream: %s", opened.replica, exc)
                self.stream_failures.inc()
                finished = True
                err = {"error": {"message": f"the engine replica {opened.replica} serving this stream failed after "
                                            f"it had sent output ({type(exc).__name__}); retry the request",
                                 "type": "service_unavailable_error", "param": None, "code": "replica_failed"}}
                yield f"data: {json.dumps(err)}\n\n".encode()
                yield b"data: [DONE]\n\n"
        finally:
            if not finished:
                opened.gen.cancel()  # the client went away: abort the request on its replica

    # ---- the app ----------------------------------------------------------------------------------------

    def __serve_build_asgi_app__(self) -> FastAPI:
        app = FastAPI(title="specdecode cluster", version=__version__, docs_url=None, redoc_url=None,
                      openapi_url=None)
        ingress = self

        @app.get("/health")
        async def health() -> JSONResponse:
            infos = await ingress._each("info", timeout=5)
            healthy = sorted(r for r, i in infos.items() if i.get("healthy"))
            status = 200 if healthy else 503
            return JSONResponse({"status": "ok" if healthy else "no healthy engine replica",
                                 "replicas": healthy}, status_code=status)

        @app.get("/metrics")
        async def metrics(request: Request) -> Response:
            if not ingress.auth.ok(request):
                return _error(401, "missing or invalid API key", "invalid_api_key", "authentication_error")
            texts = await ingress._each("metrics_text")
            extra = generate_latest(ingress.registry).decode() + generate_latest(ROUTER_REGISTRY).decode()
            body = merge_metrics({rid: r["text"] for rid, r in texts.items()}, extra)
            return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

        @app.get("/cluster/replicas")
        async def replicas(request: Request) -> JSONResponse:
            if not ingress.auth.ok(request):
                return _error(401, "missing or invalid API key", "invalid_api_key", "authentication_error")
            infos = await ingress._each("info", timeout=5)
            return JSONResponse({"replicas": [infos[r] for r in sorted(infos)], "time": time.time()})

        @app.api_route("/{path:path}", methods=["GET", "POST"])
        async def forward(request: Request) -> Response:
            return await ingress.forward(request)

        # As on one server: a body over the limit is a 413 by its Content-Length, or as soon as a chunked one
        # passes the limit, before the ingress holds more of it.
        app.add_middleware(BodyLimitMiddleware, limit=ingress.cfg.max_body_bytes, metrics=ingress.errors)
        return app


# ---- the application -------------------------------------------------------------------------------------


def _proxy_back_pressure() -> dict[str, Any]:
    """The ingress's own queue at the HTTP proxy, answered with a 429 and Retry-After once full (a 503 on a Ray
    Serve without `BackpressureConfig`)."""
    options: dict[str, Any] = {"max_queued_requests": INGRESS_QUEUE}
    try:
        from ray.serve.config import BackpressureConfig
    except ImportError:  # pragma: no cover - older Ray Serve
        return options
    return {**options, "backpressure_config": BackpressureConfig(status_code=429, retry_after_s=RETRY_AFTER_S)}


def build_application(cfg: ClusterConfig) -> Any:
    """The Ray Serve application (`serve.run(build_application(cfg), route_prefix="/")`)."""
    engine_options: dict[str, Any] = {
        "name": ENGINE_DEPLOYMENT,
        "ray_actor_options": {"num_cpus": cfg.replica_threads, "num_gpus": cfg.replica_gpus},
        "max_ongoing_requests": cfg.max_ongoing_requests,
        "max_queued_requests": cfg.queued_requests,  # the ingress's handle: beyond it BackPressureError, a 429
        "health_check_period_s": cfg.health_check_period_s,
        "health_check_timeout_s": 60,
        "graceful_shutdown_timeout_s": cfg.drain_timeout_s,
        "request_router_config": RequestRouterConfig(request_router_class=ROUTER_PATH,
                                                     request_router_kwargs={"saturation": cfg.saturation}),
    }
    if cfg.autoscaling:
        engine_options["autoscaling_config"] = {
            "min_replicas": cfg.min_replicas, "max_replicas": cfg.max_replicas, "initial_replicas": cfg.replicas,
            "target_ongoing_requests": cfg.target_ongoing_requests or cfg.max_num_seqs,
            "upscale_delay_s": 5, "downscale_delay_s": 60,
        }
    else:
        engine_options["num_replicas"] = cfg.replicas
    engine = serve.deployment(EngineReplica).options(**engine_options)
    ingress = serve.deployment(Ingress).options(name=INGRESS_DEPLOYMENT, num_replicas=1,
                                                ray_actor_options={"num_cpus": 0}, max_ongoing_requests=100_000,
                                                **_proxy_back_pressure())
    config = cfg.to_dict()
    return ingress.bind(engine.bind(config), config)
