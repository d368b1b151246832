"""OpenAI error bodies: `{"error": {"message", "type", "code", "param"}}`, with the `type` OpenAI
gives each HTTP status (`invalid_request_error`, `authentication_error`, `permission_error`,
`not_found_error`, `rate_limit_error`, `server_error`) and the HTTP status of each of firsttoken's
error codes. Every error body of the API, its streams and batch output lines is made here."""

from __future__ import annotations

from typing import Any

from schemas.job import ErrorCode

# the HTTP status of a job that ended with this error code (a completion's response, a batch
# output line's status_code)
HTTP_STATUS = {
    ErrorCode.INVALID_REQUEST: 400,
    ErrorCode.PROMPT_TOO_LONG: 400,
    ErrorCode.INVALID_SAMPLING: 400,
    ErrorCode.INVALID_GRAMMAR: 400,
    ErrorCode.UNDECODABLE: 400,
    ErrorCode.DUPLICATE_ID: 400,
    ErrorCode.TOO_LARGE: 413,
    ErrorCode.CANCELLED: 499,
    ErrorCode.ENGINE_ERROR: 500,
    ErrorCode.INTERNAL_ERROR: 500,
}

_TYPES = {401: "authentication_error", 403: "permission_error", 404: "not_found_error", 429: "rate_limit_error"}


def error_type(status: int) -> str:
    """OpenAI's error `type` for an HTTP status: its own for 401, 403, 404 and 429, `server_error`
    from 500 on, `invalid_request_error` for every other status."""
    if status >= 500:
        return "server_error"
    return _TYPES.get(status, "invalid_request_error")


def error_body(code: str, message: str, *, status: int, param: str | None = None, **extra: Any) -> dict[str, Any]:
    """The error envelope of a response with this HTTP status; `code` says which rule."""
    return {"error": {"code": str(code), "type": error_type(status), "message": message, "param": param, **extra}}
