"""The app's exception handlers: every error OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`),
never an HTML page or a bare 500, and counted in the metrics by status."""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from specdecode.server.errors import APIError, error_body
from specdecode.server.metrics import ServerMetrics

logger = logging.getLogger("specdecode.server")

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict"}


def error_response(metrics: ServerMetrics, status: int, message: str, param: str | None = None,
                   code: str | int | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    metrics.request_errors.labels(code=str(status)).inc()
    return JSONResponse(error_body(status, message, param, code), status_code=status, headers=headers)


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


def add_error_handlers(app: FastAPI, metrics: ServerMetrics) -> None:
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
