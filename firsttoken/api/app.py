"""The HTTP API (FastAPI): `create_app()` wires the routers (jobs, batches, files, OpenAI
completions) to the store, the queue and the reply channel.

The store, the queue and the Redis reply waiter are created on startup (never at import) from
the settings, unless passed in (tests). Every route but /healthz needs `Authorization: Bearer
<key>` with a key of FIRSTTOKEN_API_KEYS; each key has an owner, and an owner sees, cancels and
adds to only its own jobs, batches and files (another owner's are 404, as if they did not exist).
Without keys the app refuses to start unless authentication is switched off explicitly
(FIRSTTOKEN_API_NO_AUTH, for local use).

OpenAI batches past their 24h window are expired by a sweep every api_expire_every_s (and on
each read). Bodies are read up to a limit (413 past it) and parsed on a worker thread, never on the event
loop. Errors are `{"error": {"code", "type", "message"}}`; a 422 names the field and the rule,
never echoes the input; no input gives a 500. A path, query or header holding a NUL (or not
UTF-8 text) is refused at the edge (firsttoken.api.edge), before any route; an unexpected error
is logged as its types and frames only (no message: it may quote SQL values or a prompt). A
trailing slash is a 404, never a redirect built from the Host header.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.engine import make_url
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from firsttoken.api import batches, completions, files, jobs, metrics
from firsttoken.api.deps import ApiError, ApiState, Canceller, ConfigError, authenticator
from firsttoken.api.edge import EdgeGuard, describe_exception
from pipeline.producer import JobCheck
from pipeline.queue.base import JobQueue
from pipeline.replies import ReplyWaiter
from pipeline.settings import Settings, get_settings
from pipeline.store import ResultStore
from schemas.job import ErrorCode
from schemas.openai import error_body

log = logging.getLogger(__name__)

__all__ = ["ConfigError", "celery_canceller", "create_app"]

_DEFAULT = object()


def celery_canceller(job_ids: Sequence[str], batch_id: str | None) -> None:
    """Tell every GPU worker to abort these jobs (Celery remote-control broadcast, no reply awaited)."""
    from workers.celery_app import broadcast_cancel

    broadcast_cancel(list(job_ids), batch_id)


async def _expiry_sweep(state: ApiState) -> None:
    """Expire OpenAI batches past their window every api_expire_every_s, read or not."""
    every = state.settings.api_expire_every_s
    while True:
        await asyncio.sleep(every)
        try:
            n = await run_in_threadpool(batches.expire_due, state)
        except Exception as exc:  # the database away for a while: the next sweep tries again
            log.warning("batch expiry sweep failed: %s", type(exc).__name__)
            continue
        if n:
            log.info("expired %d batches past their completion window", n)


class _App(FastAPI):
    """FastAPI with the edge guard outside everything (Starlette's error middleware included)."""

    def build_middleware_stack(self):  # type: ignore[no-untyped-def]
        return EdgeGuard(super().build_middleware_stack())


def create_app(
    settings: Settings | None = None,
    *,
    store: ResultStore | None = None,
    queue: JobQueue | None = None,
    canceller: Canceller | None = celery_canceller,
    check: JobCheck | None = None,
    replies: Any = _DEFAULT,
) -> FastAPI:
    """The API app. Without `store`/`queue`/`replies`, they are built from `settings` at startup
    (`replies=None`: no reply channel, so no completions). `check` (default: the settings'
    check_model's context check, when set) runs on each job at submission.

    Raises ConfigError when there are no API keys and authentication is not switched off.
    """
    s = settings or get_settings()
    state = ApiState(
        settings=s,
        authenticate=authenticator(s),
        store=store,
        queue=queue,
        check=check,
        canceller=canceller,
        model_name=s.model,
    )

    @asynccontextmanager
    async def lifespan(_app: FastAPI):  # type: ignore[no-untyped-def]
        if state.store is None:
            state.store = ResultStore.from_url(s.database_url, batch_rows=s.store_batch_rows)
            state.owned.append(state.store)
        if state.queue is None:
            from pipeline.queue.kafka import KafkaQueue

            state.queue = KafkaQueue(s)
            state.owned.append(state.queue)
        if replies is _DEFAULT:
            db = make_url(s.database_url)
            if s.reply_secret is None and db.get_backend_name() == "postgresql" and not db.password:
                log.warning("replies on Redis are signed with a key derived from a database URL without a "
                            "password: set FIRSTTOKEN_REPLY_SECRET (the same for the API and the workers)")
            state.replies = ReplyWaiter(s.redis_url, key=s.reply_key)
        else:
            state.replies = replies
        if state.check is None and s.check_model:
            from workers.engine.prompts import SubmitCheck

            state.check = SubmitCheck.for_model(s.check_model, s.check_max_model_len)
        sweep = asyncio.get_running_loop().create_task(_expiry_sweep(state)) if s.api_expire_every_s else None
        try:
            yield
        finally:
            if sweep is not None:
                sweep.cancel()
                with contextlib.suppress(BaseException):
                    await sweep
            for x in state.owned:
                x.close()
            if replies is _DEFAULT and state.replies is not None:
                await state.replies.close()

    app = _App(title="firsttoken", version="0.2", lifespan=lifespan, redirect_slashes=False)
    app.state.api = state
    app.state.metrics = metrics.ApiMetrics(lambda: state.store, lambda: state.replies,
                                           max_age_s=s.api_metrics_max_age_s)
    app.middleware("http")(app.state.metrics.middleware)

    @app.exception_handler(ApiError)
    async def _api_error(_request: Request, exc: ApiError) -> JSONResponse:
        headers = {"WWW-Authenticate": "Bearer"} if exc.status == 401 else exc.headers
        return JSONResponse(error_body(exc.code, exc.message, status=exc.status, **exc.extra), exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for e in exc.errors()[:10]:
            loc = ".".join(str(x) for x in e.get("loc", ()) if x not in ("body", "query", "path"))
            parts.append(f"{loc or 'request'}: {str(e.get('msg', 'invalid'))[:200]}")
        return JSONResponse(error_body(ErrorCode.INVALID_REQUEST, "; ".join(parts), status=422), 422)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return JSONResponse(error_body("http_error", str(exc.detail)[:500], status=exc.status_code), exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(ClientDisconnect)
    async def _gone(_request: Request, _exc: ClientDisconnect) -> JSONResponse:  # nobody reads it; nothing to log
        return JSONResponse(error_body(ErrorCode.CANCELLED, "the client disconnected", status=499), 499)

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        log.error("unhandled %s", describe_exception(exc))  # no message, no traceback text: no values
        with contextlib.suppress(Exception):
            exc.firsttoken_logged = True  # type: ignore[attr-defined]  # (EdgeGuard sees it again)
        return JSONResponse(error_body(ErrorCode.INTERNAL_ERROR, "internal error", status=500), 500)

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        from sqlalchemy import text

        try:
            with state.st.engine.connect() as conn:
                conn.execute(text("SELECT 1"))
        except Exception as exc:
            raise ApiError(503, "unavailable", f"database: {type(exc).__name__}") from None
        return {"ok": True}

    for module in (jobs, batches, files, completions, metrics):
        app.include_router(module.router)
    return app
