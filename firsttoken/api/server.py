"""The API's HTTP server: uvicorn with limits a public endpoint needs.

- connections and requests at once: api_max_connections (uvicorn's limit_concurrency; past it 503);
- a request header at most api_max_header_bytes (h11's incomplete event size; past it 400);
- deadlines for what the client sends: a connection has api_header_timeout_s to send a request's
  whole header (from when it opened, or from its last response), and a request api_body_timeout_s
  to send its whole body; past one the connection is closed (a client sending a byte a second
  holds nothing for long). A request the app is working on, or a response being sent, has no
  deadline here (completions have their own: api_completion_timeout_s).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from pipeline.settings import Settings

log = logging.getLogger("firsttoken.api")


class DeadlineH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with header and body read deadlines (class attributes, set by
    `protocol_with_deadlines`)."""

    header_timeout_s: float = 10.0
    body_timeout_s: float = 120.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._deadline: asyncio.TimerHandle | None = None
        self._timed_cycle: Any = None
        self._phase = "header"
        super().connection_made(transport)
        self._arm("header", self.header_timeout_s)

    def _arm(self, phase: str, seconds: float) -> None:
        self._disarm()
        self._phase = phase
        self._deadline = self.loop.call_later(seconds, self._expired)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None
        self._phase = ""

    def _expired(self) -> None:
        self._deadline = None
        if self.transport.is_closing():
            return
        cycle = self.cycle
        waiting_header = self._phase == "header" and (cycle is None or cycle.response_complete)
        waiting_body = self._phase == "body" and cycle is not None and cycle.more_body and not cycle.response_complete
        if waiting_header or waiting_body:
            log.info("closed a connection from %s: its request %s did not arrive within %.0f s",
                     f"{self.client[0]}:{self.client[1]}" if self.client else "?", self._phase,
                     self.header_timeout_s if waiting_header else self.body_timeout_s)
            self.transport.close()

    def handle_events(self) -> None:
        super().handle_events()
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return  # still waiting for a request's header: its deadline stands
        if cycle is not self._timed_cycle:  # a request began
            self._timed_cycle = cycle
            if cycle.more_body:
                self._arm("body", self.body_timeout_s)
            else:
                self._disarm()
        elif self._phase == "body" and not cycle.more_body:
            self._disarm()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._arm("header", self.header_timeout_s)  # the next request's (a pipelined one re-arms below)
        super().on_response_complete()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)


def protocol_with_deadlines(header_timeout_s: float, body_timeout_s: float) -> type[DeadlineH11Protocol]:
    """A DeadlineH11Protocol class with these deadlines."""
    return type("FirsttokenH11Protocol", (DeadlineH11Protocol,),
                {"header_timeout_s": header_timeout_s, "body_timeout_s": body_timeout_s})


def log_config() -> dict[str, Any]:
    """uvicorn's logging, and firsttoken's own loggers (firsttoken.*, pipeline.*) at INFO on the
    same handler (else only their warnings reach stderr)."""
    import copy

    from uvicorn.config import LOGGING_CONFIG

    cfg = copy.deepcopy(LOGGING_CONFIG)
    for name in ("firsttoken", "pipeline"):
        cfg["loggers"][name] = {"handlers": ["default"], "level": "INFO", "propagate": False}
    return cfg


def server_config(app: Any, settings: Settings, *, host: str, port: int) -> Any:
    """uvicorn's Config for the API app with the settings' limits and deadlines."""
    import uvicorn

    return uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level="info",
        log_config=log_config(),
        http=protocol_with_deadlines(settings.api_header_timeout_s, settings.api_body_timeout_s),
        limit_concurrency=settings.api_max_connections,
        h11_max_incomplete_event_size=settings.api_max_header_bytes,
        timeout_keep_alive=5,
        server_header=False,
    )


def serve(app: Any, settings: Settings, *, host: str, port: int) -> None:
    """Serve the API app until SIGINT/SIGTERM."""
    import uvicorn

    uvicorn.Server(server_config(app, settings, host=host, port=port)).run()
