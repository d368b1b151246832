"""Readiness probe for the local Kafka broker, standard library only.

Exits 0 when the broker at HOST:PORT answers a Metadata request (v4) that lists at least one
live broker, 1 otherwise. With CREDENTIALS (a file of two lines, user and password: the marker
scripts/services.sh writes) it first authenticates with SASL/PLAIN (SaslHandshake v1, then
SaslAuthenticate v0), as the broker's listener requires. Used by scripts/services.sh before the
project's venv may exist.

    python3 scripts/kafka/probe.py HOST PORT [CREDENTIALS]
"""

from __future__ import annotations

import socket
import struct
import sys
from pathlib import Path

_API_METADATA = 3
_VERSION = 4  # Kafka 4.x serves Metadata v4..v13; v4 is the oldest, with a non-flexible encoding
_API_SASL_HANDSHAKE = 17
_API_SASL_AUTHENTICATE = 36
_CLIENT_ID = b"firsttoken-probe"


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return buf


def _call(sock: socket.socket, api: int, version: int, correlation: int, body: bytes) -> bytes:
    """One request with a v1 header (api_key, api_version, correlation_id, client_id); the
    response without its correlation id."""
    request = struct.pack(">hhih", api, version, correlation, len(_CLIENT_ID)) + _CLIENT_ID + body
    sock.sendall(struct.pack(">i", len(request)) + request)
    (size,) = struct.unpack(">i", _read_exact(sock, 4))
    response = _read_exact(sock, size)
    (got,) = struct.unpack_from(">i", response, 0)
    if got != correlation:
        raise ConnectionError(f"correlation id {got}, expected {correlation}")
    return response[4:]


def _authenticate(sock: socket.socket, user: str, password: str) -> None:
    mechanism = b"PLAIN"
    answer = _call(sock, _API_SASL_HANDSHAKE, 1, 1, struct.pack(">h", len(mechanism)) + mechanism)
    (error,) = struct.unpack_from(">h", answer, 0)
    if error:
        raise ConnectionError(f"SaslHandshake error {error}")
    token = b"\0" + user.encode() + b"\0" + password.encode()
    answer = _call(sock, _API_SASL_AUTHENTICATE, 0, 2, struct.pack(">i", len(token)) + token)
    (error,) = struct.unpack_from(">h", answer, 0)
    if error:
        raise ConnectionError(f"SaslAuthenticate error {error}")


def live_brokers(host: str, port: int, credentials: tuple[str, str] | None = None, timeout: float = 2.0) -> int:
    """Number of brokers the Metadata response lists."""
    with socket.create_connection((host, port), timeout=timeout) as sock:
        if credentials is not None:
            _authenticate(sock, *credentials)
        # body: topics=null (all), no auto-create
        response = _call(sock, _API_METADATA, _VERSION, 3, struct.pack(">ib", -1, 0))
    # response (after the correlation id): throttle_time_ms, brokers array length, ...
    _, n_brokers = struct.unpack_from(">ii", response, 0)
    return n_brokers


def main() -> int:
    host, port = sys.argv[1], int(sys.argv[2])
    credentials = None
    if len(sys.argv) > 3:
        try:
            user, password = Path(sys.argv[3]).read_text().splitlines()[:2]
        except (OSError, ValueError):
            return 1  # the broker's marker is not written yet
        credentials = (user, password)
    try:
        return 0 if live_brokers(host, port, credentials) > 0 else 1
    except (OSError, struct.error):
        return 1


if __name__ == "__main__":
    sys.exit(main())
