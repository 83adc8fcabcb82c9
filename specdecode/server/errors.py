"""The error a request handler raises to answer with an OpenAI-shaped 4xx/5xx body, and that body."""

from __future__ import annotations


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers


ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                408: "timeout_error", 503: "service_unavailable_error"}


def error_body(status: int, message: str, param: str | None = None, code: str | int | None = None) -> dict:
    err_type = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": err_type, "param": param, "code": code if code else status}}
