"""The OpenAI-compatible HTTP API: `build_app(llm, ...)` returns a FastAPI app.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON or SSE
streaming), GET /health, GET /metrics. Every error is OpenAI-shaped
(`{"error": {"message", "type", "param", "code"}}`): bad input is a 400, a missing or wrong
API key a 401, an oversized body a 413, a full queue a 429 with Retry-After, a request past its
deadline a 408, a server that drains before exit a 503; a 500 is an engine failure (or a bug).
Requests run on an `AsyncEngine` (a BatchEngine on its own thread); a client that goes
away (stream closed, or connection dropped while waiting for a non-streamed answer) has its
request aborted, which frees its cache row before the next step.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from specdecode import __version__
from specdecode.engine.core import Engine as BatchEngine
from specdecode.engine.llm import LLM
from specdecode.server.deadline import request_deadline, within
from specdecode.server.engine_requests import prepare_chat, prepare_completion
from specdecode.server.error_handlers import add_error_handlers
from specdecode.server.errors import APIError
from specdecode.server.lifecycle import DrainMiddleware
from specdecode.server.metrics import CONTENT_TYPE, ServerMetrics
from specdecode.server.middleware import MAX_BODY_BYTES, AuthMiddleware, BodyLimitMiddleware
from specdecode.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
)
from specdecode.server.responses import chat_response, collect, completion_response
from specdecode.server.state import Limits, ServerState
from specdecode.server.streaming import SSEResponse, chat_events, completion_events
from specdecode.server.tokenize_routes import tokenizer_router
from specdecode.server.tools import tool_plan

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request gives none: the remaining context, capped here (vLLM takes the whole remaining
context, which on an 8k context makes one forgotten field cost minutes of compute)."""

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 408, 413, 429, 503)
}


def build_app(
    llm: LLM,
    engine: BatchEngine | None = None,
    *,
    max_num_seqs: int = 8,
    max_waiting: int = 64,
    served_model_name: str | None = None,
    model_aliases: tuple[str, ...] = (),
    api_key: str | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    default_max_tokens: int = DEFAULT_MAX_TOKENS,
    request_timeout_s: float | None = None,
    stall_timeout_s: float | None = 60.0,
    on_engine_death: Callable[[int], None] | None = None,
) -> FastAPI:
    """An OpenAI-compatible app serving `llm` through a continuous-batching engine.

    Args:
        llm: the loaded model (and proposer); its weights are shared, the batch engine has its own cache.
        engine: a BatchEngine to use (default: `llm.batch_engine(max_num_seqs, max_waiting)`).
        served_model_name: the model id clients send and /v1/models lists (default: the name the LLM was
            loaded under); `model_aliases` are accepted too.
        api_key: if given, every endpoint but /health requires `Authorization: Bearer <api_key>`.
        max_body_bytes: larger request bodies get a 413.
        default_max_tokens: max_tokens of a request that gives none is min(this, remaining context).
        request_timeout_s: the longest a request may take (None: no limit); a request's `timeout` may shorten it.
        stall_timeout_s: /health answers 503 once one engine step has run this long (None or 0: never).
        on_engine_death: called with the exit code (1) when the engine's loop fails outside its step (every
            request in flight has got its error by then); `specdecode serve` exits the process with it.
    The engine thread starts with the app (its lifespan) and stops with it.
    """
    if engine is None:
        engine = llm.batch_engine(max_num_seqs=max_num_seqs, max_waiting=max_waiting)
    name = served_model_name or llm.target.name
    metrics = ServerMetrics()
    aliases = {*model_aliases, llm.target.name, str(llm.target.path)}
    state = ServerState(llm, engine, name, aliases, default_max_tokens, metrics,
                        Limits(request_timeout_s, stall_timeout_s), on_engine_death)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        try:
            yield
        finally:
            state.engine.stop()
            state.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdecode", version=__version__, lifespan=lifespan,
                  description="OpenAI-compatible API over a speculative-decoding engine.")
    app.state.server = state
    app.state.engine = state.engine
    app.state.metrics = metrics

    add_error_handlers(app, metrics)

    # ---- endpoints ---------------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        engine = state.engine
        if state.lifecycle.draining:
            problem = "draining: the server is shutting down"
        elif not engine.alive:
            problem = f"engine not running ({engine.died})" if engine.died else "engine not running"
        elif engine.stalled:
            problem = (f"engine stalled: one step has run for {engine.busy_seconds:.0f} s "
                       f"(--stall-timeout {engine.stall_timeout_s:g} s)")
        else:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": problem}, status_code=503)

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=state.model_name, created=state.created,
                                         max_model_len=llm.max_model_len)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def model_card(model_id: str) -> ModelCard:
        if model_id not in state.accepted_names:
            raise APIError(404, f"model {model_id!r} is not served here", "model", "model_not_found")
        return ModelCard(id=state.model_name, created=state.created, max_model_len=llm.max_model_len)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        deadline = request_deadline(state.limits.request_timeout_s, body.timeout)
        rid = f"cmpl-{uuid.uuid4().hex}"
        async with within(deadline):  # past it: the choices aborted, a 408
            stream = await prepare_completion(state, body)
            if not body.stream:
                choices = await collect(stream, request)
                return JSONResponse(completion_response(state, rid, choices, stream, body.logprobs is not None))
        include = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(completion_events(state, stream, rid, include, deadline), stream)

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        deadline = request_deadline(state.limits.request_timeout_s, body.timeout)
        plan = tool_plan(body, state.llm.tokenizer.hf)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        async with within(deadline):
            stream = await prepare_chat(state, body, plan)
            if not body.stream:
                choices = await collect(stream, request)
                return JSONResponse(chat_response(state, rid, choices, stream, plan, bool(body.logprobs)))
        include = bool(body.stream_options and body.stream_options.include_usage)
        return SSEResponse(chat_events(state, stream, rid, include, plan, deadline), stream)

    app.include_router(tokenizer_router(state))

    # Outermost first: the auth check, then the body limit, then the drain's count and refusal, then FastAPI.
    app.add_middleware(DrainMiddleware, lifecycle=state.lifecycle, metrics=metrics)
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes, metrics=metrics)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key, metrics=metrics)
    return app

