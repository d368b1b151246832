"""What the API checks before any route runs, and how it logs what went wrong.

`EdgeGuard` wraps the whole app (outside Starlette's error middleware): a request whose path or
query (percent-decoded) holds a NUL byte or is not UTF-8 text (a lone surrogate encoded in it
is not), or whose header values hold a NUL, is refused with 400 invalid_request before any
route, so before any database call. It also catches what escapes the app: the error middleware
re-raises every exception for the server to log, and uvicorn would log it with its message
(which may quote a SQL statement's values or a prompt); here it is logged once, scrubbed, and
dropped. Bodies are checked where they are parsed (schemas.batchfile.loads_strict refuses a NUL,
a lone surrogate and 1e400 in any string of a JSON body; `clean_text` for multipart fields).
"""

from __future__ import annotations

import json
import logging
import traceback
from typing import Any
from urllib.parse import unquote_to_bytes

from schemas.openai import error_body

log = logging.getLogger("firsttoken.api")

Scope = dict[str, Any]


def clean_text(value: str) -> bool:
    """True when `value` holds no NUL and no lone surrogate (text Postgres and JSON can carry)."""
    if "\x00" in value:
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _clean_bytes(raw: bytes) -> bool:
    """Percent-decoded `raw` is UTF-8 text without NUL."""
    decoded = unquote_to_bytes(raw)
    if b"\x00" in decoded:
        return False
    try:
        decoded.decode("utf-8")
    except UnicodeDecodeError:
        return False
    return True


def request_problem(scope: Scope) -> str | None:
    """Why the edge refuses this request (names the part, never quotes it), or None."""
    raw_path = scope.get("raw_path")
    path = scope.get("path", "")
    if (raw_path is not None and not _clean_bytes(raw_path)) or not clean_text(path):
        return "the path holds a NUL byte or is not UTF-8 text"
    query = scope.get("query_string", b"")
    if query and not _clean_bytes(query.replace(b"+", b" ")):
        return "the query string holds a NUL byte or is not UTF-8 text"
    for _name, value in scope.get("headers", ()):
        if b"\x00" in value:
            return "a header holds a NUL byte"
    return None


def describe_exception(exc: BaseException) -> str:
    """An exception as its types and frames (file:line function), without any message: a
    message may carry a SQL statement's parameters or a prompt."""
    parts: list[str] = []
    seen: set[int] = set()
    e: BaseException | None = exc
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        frames = traceback.extract_tb(e.__traceback__)[-8:]
        where = " <- ".join(f"{'/'.join(f.filename.split('/')[-2:])}:{f.lineno} {f.name}" for f in reversed(frames))
        parts.append(f"{type(e).__module__}.{type(e).__qualname__} at {where or '?'}")
        e = e.__cause__ or (None if e.__suppress_context__ else e.__context__)
    return "; caused by ".join(parts)


def _error(message: str) -> bytes:
    return json.dumps(error_body("invalid_request", message, status=400)).encode()


class EdgeGuard:
    """ASGI wrapper of the app: refuses hostile paths, queries and headers with 400, and logs what
    escapes the app without its message."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":  # lifespan (a failed startup must stop the server), websockets
            await self.app(scope, receive, send)
            return
        problem = request_problem(scope)
        if problem is not None:
            body = _error(problem)
            await send({"type": "http.response.start", "status": 400,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body})
            return
        try:
            await self.app(scope, receive, send)
        except Exception as exc:  # already answered 500 (or the response was under way): log it scrubbed
            if not getattr(exc, "firsttoken_logged", False):
                log.error("unhandled %s", describe_exception(exc))
