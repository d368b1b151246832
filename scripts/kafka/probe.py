"""Readiness probe for the local Kafka broker, standard library only.

Exits 0 when the broker at HOST:PORT answers a Metadata request (v4) that lists at least one
live broker, 1 otherwise. Used by scripts/services.sh before the project's venv may exist.
"""

from __future__ import annotations

import socket
import struct
import sys

_API_METADATA = 3
_VERSION = 4  # Kafka 4.x serves Metadata v4..v13; v4 is the oldest, with a non-flexible encoding


def _read_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise ConnectionError("broker closed the connection")
        buf += chunk
    return buf


def live_brokers(host: str, port: int, timeout: float = 2.0) -> int:
    """Number of brokers the Metadata response lists."""
    client_id = b"firsttoken-probe"
    # header: api_key, api_version, correlation_id, client_id; body: topics=null (all), no auto-create
    request = struct.pack(">hhih", _API_METADATA, _VERSION, 1, len(client_id)) + client_id
    request += struct.pack(">ib", -1, 0)
    with socket.create_connection((host, port), timeout=timeout) as sock:
        sock.sendall(struct.pack(">i", len(request)) + request)
        (size,) = struct.unpack(">i", _read_exact(sock, 4))
        response = _read_exact(sock, size)
    # response: correlation_id, throttle_time_ms, brokers array length, ...
    _, _, n_brokers = struct.unpack_from(">iii", response, 0)
    return n_brokers


def main() -> int:
    host, port = sys.argv[1], int(sys.argv[2])
    try:
        return 0 if live_brokers(host, port) > 0 else 1
    except (OSError, struct.error):
        return 1


if __name__ == "__main__":
    sys.exit(main())
