"""Requests on the wire at once: kafka-python's plain TCP transport, writing eagerly.

kafka-python 3's `KafkaTCPTransport.write` only queues the bytes and schedules a task; the task
waits for the socket to be writable, one event-loop turn, and sends on the next: ~0.5 ms from a
request being built to its bytes leaving (measured on the 2-core machine, produce requests of
one job, bench/results/pipeline-2026-11-30-run4.md). Here `write` first tries a non-blocking
`send` when nothing is queued before it, as asyncio's selector transports do; what the socket
does not take goes the original way. `write` runs on the thread that drives the client's event
loop (the producer's sender thread, the consumer's IO thread), so no other send can be under
way. TLS transports are left as they are.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from kafka.net.transport import KafkaTCPTransport

_lock = threading.Lock()
_original_write: Any = None


def _eager_write(self: KafkaTCPTransport, data: Any) -> None:
    if (
        type(self) is KafkaTCPTransport
        and data
        and not self._writing
        and not self._write_buffer
        and self._write
        and not self._closed
        and self._sock is not None
    ):
        try:
            sent = self._sock.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            sent = 0  # the queued path reports the error as it always did
        if sent:
            self.last_write = time.monotonic()
        if sent == len(data):
            return
        data = memoryview(data)[sent:]
    _original_write(self, data)


def install_eager_writes() -> None:
    """Make every plain-TCP kafka-python transport in this process write eagerly (idempotent)."""
    global _original_write
    with _lock:
        if _original_write is None:
            _original_write = KafkaTCPTransport.write
            KafkaTCPTransport.write = _eager_write  # type: ignore[method-assign]


def eager_writes_installed() -> bool:
    """True once install_eager_writes ran."""
    return _original_write is not None
