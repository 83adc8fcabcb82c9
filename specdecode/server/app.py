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

import asyncio
import hmac
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from specdecode.engine.core import Engine as BatchEngine
from specdecode.engine.core import QueueFullError
from specdecode.engine.llm import LLM
from specdecode.engine.sequence import Sequence
from specdecode.sampling import SamplingParams
from specdecode.server.async_engine import AsyncEngine, EngineDeadError, RequestStream, Update
from specdecode.server.errors import APIError
from specdecode.server.metrics import CONTENT_TYPE, ServerMetrics
from specdecode.server.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    PromptTokensDetails,
    SpeculativeUsage,
    Usage,
)
from specdecode.server.tokenize_routes import tokenizer_router

logger = logging.getLogger("specdecode.server")

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request gives none: the remaining context, capped here (vLLM takes the whole remaining
context, which on an 8k context makes one forgotten field cost minutes of compute)."""
MAX_BODY_BYTES = 1 << 20
RETRY_AFTER_S = 1

_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                503: "service_unavailable_error"}
_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}
_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    err_type = _ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code if code else status}}


def error_response(metrics: ServerMetrics, status: int, message: str, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    metrics.request_errors.labels(code=str(status)).inc()
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


# ---- pure ASGI middlewares (run before FastAPI parses anything) -------------------------------------------


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


class _SSEResponse(StreamingResponse):
    """A streaming response that aborts its request however the stream ends (done, disconnect, cancel)."""

    def __init__(self, content: AsyncIterator[str], stream: RequestStream) -> None:
        super().__init__(content, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._stream.close()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _check_text(text: str, param: str) -> None:
    """Refuse strings that are not valid Unicode (JSON "\\ud800" escapes decode to lone surrogates)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise APIError(400, f"{param} is not valid Unicode (a lone surrogate escape)", param) from None


def _param_from_loc(loc: tuple[Any, ...]) -> str | None:
    """('body', 'messages', 0, 'content', 'str') -> 'messages[0].content' (union tags dropped)."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and part.isidentifier() and part not in _TYPE_TAGS:
            out += f".{part}" if out else part
        else:
            break
    return out or None


# ---- the app -------------------------------------------------------------------------------------------


class _Server:
    """State of one app: the model, the engine thread, metrics, and the request handling."""

    def __init__(self, llm: LLM, engine: BatchEngine, served_model_name: str, aliases: set[str],
                 default_max_tokens: int, metrics: ServerMetrics) -> None:
        self.llm = llm
        self.metrics = metrics
        self.engine = AsyncEngine(engine, metrics)
        self.model_name = served_model_name
        self.accepted_names = {served_model_name, *aliases}
        self.default_max_tokens = default_max_tokens
        self.vocab_size = llm.target.config.vocab_size
        self.created = int(time.time())
        self.tokenize_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="specdecode-tokenize")

    # ---- request preparation --------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_names:
            raise APIError(400, f"model {model!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", "model", "model_not_found")

    def _check_common(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        self.check_model(body.model)
        if body.n not in (None, 1):
            raise APIError(400, "n > 1 is not supported; send one request per completion", "n")
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")

    async def run_tokenizer(self, fn: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn)

    def _sequence(self, body: ChatCompletionRequest | CompletionRequest, ids: list[int], prompt_field: str,
                  max_tokens: int | None) -> Sequence:
        if any(t >= self.vocab_size for t in ids):
            raise APIError(400, f"token ids must be < the vocabulary size {self.vocab_size}", prompt_field)
        room = self.llm.max_model_len - len(ids)
        if room < 1:
            raise APIError(400, f"the prompt ({len(ids)} tokens) fills the context length {self.llm.max_model_len}: "
                                "no room for output", prompt_field, "context_length_exceeded")
        if max_tokens is None:
            max_tokens = min(self.default_max_tokens, room)
        elif max_tokens > room:
            raise APIError(400, f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the context length "
                                f"{self.llm.max_model_len}", "max_tokens", "context_length_exceeded")
        given = {
            "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
            "repetition_penalty": body.repetition_penalty, "presence_penalty": body.presence_penalty,
            "frequency_penalty": body.frequency_penalty, "seed": body.seed,
        }
        kwargs: dict[str, Any] = {k: v for k, v in given.items() if v is not None}
        stop = body.stop
        kwargs["stop"] = (stop,) if isinstance(stop, str) else tuple(stop or ())
        for s in kwargs["stop"]:
            _check_text(s, "stop")
        kwargs["stop_token_ids"] = tuple(body.stop_token_ids or ())
        kwargs["ignore_eos"] = bool(body.ignore_eos)
        try:
            params = SamplingParams(max_tokens=max_tokens, **kwargs)
            return self.llm.new_sequence(ids, params)
        except ValueError as exc:
            word = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), word if word in _SAMPLING_FIELDS else prompt_field) from None

    async def _submit(self, body: ChatCompletionRequest | CompletionRequest, seq: Sequence) -> RequestStream:
        spec = body.speculative
        k = spec.num_speculative_tokens if spec is not None else None
        k_override = k if isinstance(k, int) else None
        try:
            return await self.engine.add(seq, k_override)
        except QueueFullError as exc:
            raise APIError(429, f"the server is busy ({exc}); retry later", None, "rate_limit_exceeded",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "engine_unavailable",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as exc:
            raise APIError(400, str(exc), "max_tokens", "context_length_exceeded") from None

    async def prepare_completion(self, body: CompletionRequest) -> RequestStream:
        self._check_common(body)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if body.logprobs is not None:
            raise APIError(400, "logprobs are not supported", "logprobs")
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of > 1 is not supported", "best_of")
        prompt: Any = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
            prompt = prompt[0]  # a list holding one prompt
        if isinstance(prompt, str):
            if not prompt:
                raise APIError(400, "prompt is empty", "prompt")
            _check_text(prompt, "prompt")
            text = prompt
            try:
                ids = await self.run_tokenizer(lambda: self.llm.tokenizer.encode(text))
            except Exception as exc:
                raise APIError(400, f"cannot tokenize the prompt: {exc}", "prompt") from None
        else:
            ids = list(prompt)
        if not ids:
            raise APIError(400, "prompt is empty", "prompt")
        seq = self._sequence(body, ids, "prompt", body.max_tokens)
        return await self._submit(body, seq)

    async def prepare_chat(self, body: ChatCompletionRequest) -> RequestStream:
        self._check_common(body)
        if body.logprobs or body.top_logprobs:
            raise APIError(400, "logprobs are not supported", "logprobs")
        messages = [{"role": m.role, "content": m.text()} for m in body.messages]
        for i, m in enumerate(messages):
            _check_text(m["content"], f"messages[{i}].content")

        def encode() -> list[int]:
            return self.llm.chat_prompt_ids(messages)

        try:
            ids = await self.run_tokenizer(encode)
        except Exception as exc:  # the model's template may reject a conversation (roles, order)
            raise APIError(400, f"cannot apply the chat template: {exc}", "messages") from None
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        seq = self._sequence(body, ids, "messages", max_tokens)
        return await self._submit(body, seq)

    # ---- responses ----------------------------------------------------------------------------------

    @staticmethod
    def usage(stream: RequestStream, final: Update) -> dict[str, Any]:
        spec = SpeculativeUsage.from_stats(final.stats)
        return Usage(prompt_tokens=stream.prompt_tokens, completion_tokens=final.num_output,
                     total_tokens=stream.prompt_tokens + final.num_output,
                     prompt_tokens_details=PromptTokensDetails(cached_tokens=stream.seq.cached_tokens),
                     speculative=spec).model_dump()

    async def collect(self, stream: RequestStream, request: Request) -> tuple[str, Update]:
        """Wait for the whole answer; abort if the client disconnects meanwhile."""

        async def gather() -> tuple[str, Update]:
            parts = []
            async for update in stream:
                parts.append(update.text)
                if update.finished:
                    return "".join(parts), update
            raise RuntimeError("stream ended without a final update")  # pragma: no cover

        async def disconnected() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        gatherer = asyncio.ensure_future(gather())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({gatherer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not gatherer.done():
                raise APIError(499, "client disconnected")
            text, final = gatherer.result()
            if final.error is not None:
                raise APIError(500, final.error, None, "engine_error")
            return text, final
        finally:
            for task in (gatherer, watcher):
                task.cancel()
            stream.close()

    def chat_events(self, stream: RequestStream, rid: str, include_usage: bool) -> AsyncIterator[str]:
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_name}
        # Chat streams open with the role, send text as deltas, and finish with an empty delta.
        return self._events(stream, base, include_usage, lambda text: {"delta": {} if text is None else
                                                                       {"content": text}},
                            opening={"delta": {"role": "assistant", "content": ""}}, final_carries_text=False)

    def completion_events(self, stream: RequestStream, rid: str, include_usage: bool) -> AsyncIterator[str]:
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        # Completion streams carry the last piece of text in the chunk that finishes.
        return self._events(stream, base, include_usage, lambda text: {"text": text or ""},
                            opening=None, final_carries_text=True)

    def _events(
        self,
        stream: RequestStream,
        base: dict[str, Any],
        include_usage: bool,
        payload: Callable[[str | None], dict[str, Any]],
        opening: dict[str, Any] | None,
        final_carries_text: bool,
    ) -> AsyncIterator[str]:
        """SSE events of one streamed request, shared by chat and completions (they differ only in how a
        choice holds text)."""

        def chunk(fields: dict[str, Any], finish: str | None = None, **extra: Any) -> str:
            obj = {**base, "choices": [{"index": 0, **fields, "logprobs": None, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return _sse({**obj, **extra})

        async def events() -> AsyncIterator[str]:
            if opening is not None:
                yield chunk(opening)
            async for update in stream:
                if update.error is not None:
                    self.metrics.request_errors.labels(code="500").inc()
                    yield _sse(error_body(500, update.error, None, "engine_error"))
                    break
                if update.finished:
                    if update.text and not final_carries_text:
                        yield chunk(payload(update.text))
                    spec = SpeculativeUsage.from_stats(update.stats)
                    final_text = update.text if final_carries_text else None
                    yield chunk(payload(final_text), update.finish_reason,
                                speculative=spec.model_dump() if spec else None)
                    if include_usage:
                        yield _sse({**base, "choices": [], "usage": self.usage(stream, update)})
                elif update.text:
                    yield chunk(payload(update.text))
            yield "data: [DONE]\n\n"

        return events()


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
    server = _Server(llm, engine, name, aliases, default_max_tokens, metrics)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        server.engine.start()
        try:
            yield
        finally:
            server.engine.stop()
            server.tokenize_pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="specdecode", version="0.1.0", lifespan=lifespan,
                  description="OpenAI-compatible API over a speculative-decoding engine.")
    app.state.server = server
    app.state.engine = server.engine
    app.state.metrics = metrics

    # ---- errors: always OpenAI-shaped, never an HTML page or a bare 500 ----------------------------------

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return error_response(metrics, exc.status, exc.message, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        if any(e.get("type") == "json_invalid" for e in errors):
            detail = next(e for e in errors if e.get("type") == "json_invalid")
            ctx = detail.get("ctx") or {}
            return error_response(metrics, 400, f"the body is not valid JSON: {ctx.get('error', detail['msg'])}",
                                  None, "invalid_json")
        unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
        if unknown:
            names = [_param_from_loc(tuple(e.get("loc", ()))) or "body" for e in unknown]
            return error_response(metrics, 400, f"Unrecognized request argument supplied: {', '.join(names)}",
                                  names[0], "unrecognized_argument")
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        param = _param_from_loc(tuple(first.get("loc", ())))
        if param is None and first.get("type") in ("model_attributes_type", "dict_type"):
            message = "the body must be a JSON object"
        elif param is None and first.get("type") == "missing":
            message = "the body is missing"
        else:
            message = f"{param or 'body'}: {first.get('msg', 'invalid value')}"
        extra = {_param_from_loc(tuple(e.get("loc", ()))) for e in errors[1:]} - {param}
        if extra:
            message += f" (also invalid: {', '.join(sorted(p or 'body' for p in extra))})"
        return error_response(metrics, 400, message, param, "invalid_value")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(metrics, exc.status_code, str(exc.detail), None, None,
                              dict(exc.headers) if exc.headers else None)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error on %s", request.url.path)
        return error_response(metrics, 500, f"internal error: {type(exc).__name__}", None, "internal_error")

    # ---- endpoints ---------------------------------------------------------------------------------------

    @app.get("/health")
    async def health() -> JSONResponse:
        if not server.engine.alive:
            return JSONResponse({"status": "engine not running"}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models", response_model=ModelList, responses=_ERROR_RESPONSES)
    async def models() -> ModelList:
        return ModelList(data=[ModelCard(id=server.model_name, created=server.created,
                                         max_model_len=llm.max_model_len)])

    @app.get("/v1/models/{model_id:path}", response_model=ModelCard, responses=_ERROR_RESPONSES)
    async def model_card(model_id: str) -> ModelCard:
        if model_id not in server.accepted_names:
            raise APIError(404, f"model {model_id!r} is not served here", "model", "model_not_found")
        return ModelCard(id=server.model_name, created=server.created, max_model_len=llm.max_model_len)

    @app.post("/v1/completions", response_model=CompletionResponse, responses=_ERROR_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        stream = await server.prepare_completion(body)
        rid = f"cmpl-{uuid.uuid4().hex}"
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return _SSEResponse(server.completion_events(stream, rid, include), stream)
        text, final = await server.collect(stream, request)
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": server.model_name,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": final.finish_reason}],
            "usage": server.usage(stream, final),
        })

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        stream = await server.prepare_chat(body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return _SSEResponse(server.chat_events(stream, rid, include), stream)
        text, final = await server.collect(stream, request)
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": server.model_name,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                         "finish_reason": final.finish_reason}],
            "usage": server.usage(stream, final),
        })

    app.include_router(tokenizer_router(server))

    # Outermost first: the auth check, then the body limit, then FastAPI.
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes, metrics=metrics)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key, metrics=metrics)
    return app

