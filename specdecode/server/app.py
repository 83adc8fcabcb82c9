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
import dataclasses
import json
import logging
import secrets
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
from starlette.types import Receive, Scope, Send

from specdecode.engine.core import Engine as BatchEngine
from specdecode.engine.core import QueueFullError
from specdecode.engine.llm import LLM
from specdecode.engine.logprobs import TokenLogprob
from specdecode.engine.sequence import Sequence
from specdecode.sampling import SamplingParams
from specdecode.server.async_engine import AsyncEngine, EngineDeadError, Update
from specdecode.server.choices import ChoiceGroup
from specdecode.server.errors import APIError, error_body
from specdecode.server.logprobs_format import TokenText, chat_logprobs, completion_logprobs
from specdecode.server.metrics import CONTENT_TYPE, ServerMetrics
from specdecode.server.middleware import MAX_BODY_BYTES, AuthMiddleware, BodyLimitMiddleware
from specdecode.server.protocol import (
    SEED_MAX,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    ErrorResponse,
    ModelCard,
    ModelList,
    SpeculativeUsage,
)
from specdecode.server.tokenize_routes import tokenizer_router

logger = logging.getLogger("specdecode.server")

DEFAULT_MAX_TOKENS = 256
"""max_tokens when a request gives none: the remaining context, capped here (vLLM takes the whole remaining
context, which on an 8k context makes one forgotten field cost minutes of compute)."""
RETRY_AFTER_S = 1

_ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 404, 413, 429, 503)
}
_SAMPLING_FIELDS = {"max_tokens", "temperature", "top_k", "top_p", "min_p", "repetition_penalty",
                    "presence_penalty", "frequency_penalty", "seed", "stop", "stop_token_ids", "min_tokens",
                    "logit_bias", "logprobs"}
_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def error_response(metrics: ServerMetrics, status: int, message: str, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    metrics.request_errors.labels(code=str(status)).inc()
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


class _SSEResponse(StreamingResponse):
    """A streaming response that aborts its request's choices however the stream ends (done, disconnect, cancel)."""

    def __init__(self, content: AsyncIterator[str], stream: ChoiceGroup) -> None:
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


@dataclasses.dataclass
class Collected:
    """One choice of a non-streamed answer."""

    text: str
    final: Update
    logprobs: list[TokenLogprob]


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
        self.token_text = TokenText(llm.tokenizer)

    # ---- request preparation --------------------------------------------------------------------------

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.accepted_names:
            raise APIError(400, f"model {model!r} is not served here; this server serves "
                                f"{self.model_name!r} (GET /v1/models)", "model", "model_not_found")

    def _check_common(self, body: ChatCompletionRequest | CompletionRequest) -> None:
        self.check_model(body.model)
        if body.stream_options is not None and not body.stream:
            raise APIError(400, "stream_options is only allowed with stream: true", "stream_options")

    async def run_tokenizer(self, fn: Callable[[], list[int]]) -> list[int]:
        return await asyncio.get_running_loop().run_in_executor(self.tokenize_pool, fn)

    def _sequences(self, body: ChatCompletionRequest | CompletionRequest, ids: list[int], prompt_field: str,
                   max_tokens: int | None, logprobs: int | None) -> list[Sequence]:
        """The request's `n` sequences: one prompt, one prefill group, choice i seeded with seed + i."""
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
        kwargs["logprobs"] = logprobs
        kwargs["min_tokens"] = body.min_tokens or 0
        kwargs["logit_bias"] = self._logit_bias(body.logit_bias)
        n = body.n or 1
        if n > 1:  # distinct choices, reproducible with a seed
            base = body.seed if body.seed is not None else secrets.randbits(62)
            seeds = [base + i if base + i <= SEED_MAX else base - i for i in range(n)]
        try:
            params = SamplingParams(max_tokens=max_tokens, **kwargs)
            if n == 1:
                return [self.llm.new_sequence(ids, params)]
            group = object()
            seqs = [self.llm.new_sequence(ids, dataclasses.replace(params, seed=seed)) for seed in seeds]
            for seq in seqs:
                seq.prefill_group = group
            return seqs
        except ValueError as exc:
            word = str(exc).split(" ", 1)[0]
            raise APIError(400, str(exc), word if word in _SAMPLING_FIELDS else prompt_field) from None

    def _logit_bias(self, bias: dict[str, float] | None) -> dict[int, float]:
        out = {}
        for key, value in (bias or {}).items():
            if not (key.isascii() and key.isdigit()) or int(key) >= self.vocab_size:
                raise APIError(400, f"logit_bias keys must be token ids below the vocabulary size {self.vocab_size}, "
                                    f"got {key!r}", "logit_bias")
            out[int(key)] = float(value)
        return out

    async def _submit(self, body: ChatCompletionRequest | CompletionRequest, seqs: list[Sequence]) -> ChoiceGroup:
        spec = body.speculative
        k = spec.num_speculative_tokens if spec is not None else None
        k_override = k if isinstance(k, int) else None
        queue = self.engine.engine.max_waiting
        if queue is not None and len(seqs) > queue:  # could never be queued: a 429 would be retried forever
            raise APIError(400, f"n ({len(seqs)}) exceeds the requests this server queues at once ({queue})", "n")
        try:
            return ChoiceGroup(await self.engine.add_group(seqs, k_override))
        except QueueFullError as exc:
            raise APIError(429, f"the server is busy ({exc}); retry later", None, "rate_limit_exceeded",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except EngineDeadError as exc:
            raise APIError(503, str(exc), None, "engine_unavailable",
                           {"Retry-After": str(RETRY_AFTER_S)}) from None
        except ValueError as exc:
            raise APIError(400, str(exc), "max_tokens", "context_length_exceeded") from None

    async def prepare_completion(self, body: CompletionRequest) -> ChoiceGroup:
        self._check_common(body)
        if body.echo:
            raise APIError(400, "echo is not supported", "echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported", "suffix")
        if body.best_of not in (None, body.n or 1):
            raise APIError(400, "best_of other than n is not supported (no choices are generated to be dropped)",
                           "best_of")
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
        seqs = self._sequences(body, ids, "prompt", body.max_tokens, body.logprobs)
        return await self._submit(body, seqs)

    async def prepare_chat(self, body: ChatCompletionRequest) -> ChoiceGroup:
        self._check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
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
        seqs = self._sequences(body, ids, "messages", max_tokens, (body.top_logprobs or 0) if body.logprobs else None)
        return await self._submit(body, seqs)

    # ---- responses ----------------------------------------------------------------------------------

    def logprobs_formatter(self, kind: str) -> Callable[[int, list[TokenLogprob]], dict[str, Any]]:
        """(choice index, new tokens' logprobs) -> the choice's logprobs object: chat's or completions' (whose
        text offsets run on across a choice's chunks)."""
        if kind == "chat":
            return lambda i, entries: chat_logprobs(entries, self.token_text)
        offsets: dict[int, int] = {}

        def completion(i: int, entries: list[TokenLogprob]) -> dict[str, Any]:
            out = completion_logprobs(entries, self.token_text, offsets.get(i, 0))
            offsets[i] = offsets.get(i, 0) + sum(len(t) for t in out["tokens"])
            return out

        return completion

    async def collect(self, group: ChoiceGroup, request: Request) -> list[Collected]:
        """Wait for every choice's whole answer; abort them all if the client disconnects meanwhile."""

        async def gather() -> list[Collected]:
            parts: list[list[str]] = [[] for _ in group.streams]
            logprobs: list[list[TokenLogprob]] = [[] for _ in group.streams]
            finals: list[Update | None] = [None] * len(group.streams)
            async for i, update in group.updates():
                parts[i].append(update.text)
                logprobs[i] += update.logprobs or []
                if update.finished or update.error is not None:
                    finals[i] = update
            if any(f is None for f in finals):  # pragma: no cover
                raise RuntimeError("stream ended without a final update")
            return [Collected("".join(p), f, lp) for p, f, lp in zip(parts, finals, logprobs, strict=True)
                    if f is not None]

        async def disconnected() -> None:
            while not await request.is_disconnected():
                await asyncio.sleep(0.25)

        gatherer = asyncio.ensure_future(gather())
        watcher = asyncio.ensure_future(disconnected())
        try:
            await asyncio.wait({gatherer, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if not gatherer.done():
                raise APIError(499, "client disconnected")
            choices = gatherer.result()
            for c in choices:
                if c.final.error is not None:
                    raise APIError(500, c.final.error, None, "engine_error")
            return choices
        finally:
            for task in (gatherer, watcher):
                task.cancel()
            group.close()

    def chat_events(self, group: ChoiceGroup, rid: str, include_usage: bool) -> AsyncIterator[str]:
        base = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()), "model": self.model_name}
        # Chat streams open with the role, send text as deltas, and finish with an empty delta.
        return self._events(group, base, include_usage, lambda text: {"delta": {} if text is None else
                                                                      {"content": text}},
                            opening={"delta": {"role": "assistant", "content": ""}}, final_carries_text=False,
                            logprobs=self.logprobs_formatter("chat"))

    def completion_events(self, group: ChoiceGroup, rid: str, include_usage: bool) -> AsyncIterator[str]:
        base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": self.model_name}
        # Completion streams carry the last piece of text in the chunk that finishes.
        return self._events(group, base, include_usage, lambda text: {"text": text or ""},
                            opening=None, final_carries_text=True, logprobs=self.logprobs_formatter("completion"))

    def _events(
        self,
        group: ChoiceGroup,
        base: dict[str, Any],
        include_usage: bool,
        payload: Callable[[str | None], dict[str, Any]],
        opening: dict[str, Any] | None,
        final_carries_text: bool,
        logprobs: Callable[[int, list[TokenLogprob]], dict[str, Any]],
    ) -> AsyncIterator[str]:
        """SSE events of one streamed request, shared by chat and completions (they differ only in how a
        choice holds text); each choice's chunks carry its index, the first chunk of an update its tokens'
        logprobs."""

        def chunk(i: int, fields: dict[str, Any], finish: str | None = None, lp: Any = None, **extra: Any) -> str:
            obj = {**base, "choices": [{"index": i, **fields, "logprobs": lp, "finish_reason": finish}]}
            if include_usage:
                obj["usage"] = None
            return _sse({**obj, **extra})

        async def events() -> AsyncIterator[str]:
            if opening is not None:
                for i in range(len(group.streams)):
                    yield chunk(i, opening)
            finals: list[Update] = []
            async for i, update in group.updates():
                if update.error is not None:
                    self.metrics.request_errors.labels(code="500").inc()
                    yield _sse(error_body(500, update.error, None, "engine_error"))
                    break
                lp = logprobs(i, update.logprobs) if update.logprobs is not None else None
                if update.finished:
                    finals.append(update)
                    if update.text and not final_carries_text:
                        yield chunk(i, payload(update.text), lp=lp)
                        lp = None
                    spec = SpeculativeUsage.from_stats(update.stats)
                    final_text = update.text if final_carries_text else None
                    yield chunk(i, payload(final_text), update.finish_reason, lp,
                                speculative=spec.model_dump() if spec else None)
                elif update.text:
                    yield chunk(i, payload(update.text), lp=lp)
            else:
                if include_usage:
                    yield _sse({**base, "choices": [], "usage": group.usage(finals)})
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
        choices = await server.collect(stream, request)
        fmt = server.logprobs_formatter("completion")
        return JSONResponse({
            "id": rid, "object": "text_completion", "created": int(time.time()), "model": server.model_name,
            "choices": [{"index": i, "text": c.text, "logprobs": fmt(i, c.logprobs) if body.logprobs is not None
                         else None, "finish_reason": c.final.finish_reason} for i, c in enumerate(choices)],
            "usage": stream.usage([c.final for c in choices]),
        })

    @app.post("/v1/chat/completions", response_model=ChatCompletionResponse, responses=_ERROR_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Any:
        stream = await server.prepare_chat(body)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        if body.stream:
            include = bool(body.stream_options and body.stream_options.include_usage)
            return _SSEResponse(server.chat_events(stream, rid, include), stream)
        choices = await server.collect(stream, request)
        fmt = server.logprobs_formatter("chat")
        return JSONResponse({
            "id": rid, "object": "chat.completion", "created": int(time.time()), "model": server.model_name,
            "choices": [{"index": i, "message": {"role": "assistant", "content": c.text},
                         "logprobs": fmt(i, c.logprobs) if body.logprobs else None,
                         "finish_reason": c.final.finish_reason} for i, c in enumerate(choices)],
            "usage": stream.usage([c.final for c in choices]),
        })

    app.include_router(tokenizer_router(server))

    # Outermost first: the auth check, then the body limit, then FastAPI.
    app.add_middleware(BodyLimitMiddleware, limit=max_body_bytes, metrics=metrics)
    if api_key:
        app.add_middleware(AuthMiddleware, api_key=api_key, metrics=metrics)
    return app

