"""The OpenAI-compatible HTTP API: `build_app(llm, ...)` returns a FastAPI app.

Endpoints: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (JSON or SSE
streaming), GET /health, GET /metrics. Every error is OpenAI-shaped
(`{"error": {"message", "type", "param", "code"}}`): bad input is a 400, a missing or wrong
API key a 401, an oversized body a 413, a full queue a 429 with Retry-After; a 500 would be a
bug. Requests run on an `AsyncEngine` (a BatchEngine on its own thread); a client that goes
away (stream closed, or connection dropped while waiting for a non-streamed answer) has its
request aborted, which frees its cache row before the next step.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from specdecode import __version__
from specdecode.engine.core import Engine as BatchEngine
from specdecode.engine.llm import LLM
from specdecode.server.engine_requests import prepare_chat, prepare_completion
from specdecode.server.error_handlers import add_error_handlers
from specdecode.server.errors import APIError
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
from specdecode.server.state import ServerState
from specdecode.server.streaming import SSEResponse, chat_events, completion_events
from specdecode.server.tokenize_routes import tokenizer_router
from specdecode.server.tools import tool_plan

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request gives none: the remaining context, capped here (vLLM takes the whole remaining
context, which on an 8k context makes one forgotten field cost minutes of compute)."""

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
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
    The engine thread starts with the app (its lifespan) and stops with it.
    """
    if engine is None:
        engine = llm.batch_engine(max_num_seqs=max_num_seqs, max_waiting=max_waiting)
    name = served_model_name or llm.target.name
    metrics = ServerMetrics()
    aliases = {*model_aliases, llm.target.name, str(llm.target.path)}
    state = ServerState(llm, engine, name, aliases, default_max_tokens, metrics)

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
        if not state.engine.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

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
        stream = await prepare_completion(state, body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(completion_events(state, stream, rid, include), stream)
        choices = await collect(stream, request)
        return JSONResponse(completion_response(state, rid, choices, stream, body.logprobs is not None))

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        plan = tool_plan(body, state.llm.tokenizer.hf)
        stream = await prepare_chat(state, body, plan)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return SSEResponse(chat_events(state, stream, rid, include, plan), stream)
        choices = await collect(stream, request)
        return JSONResponse(chat_response(state, rid, choices, stream, plan, bool(body.logprobs)))

    app.include_router(tokenizer_router(state))

    # Outermost first: the auth check, then the body limit, then FastAPI.
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes, metrics=metrics)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key, metrics=metrics)
    return app

