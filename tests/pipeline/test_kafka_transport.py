"""Eager writes of kafka-python's TCP transport (pipeline.queue.kafka_transport)."""

from __future__ import annotations

import socket
import warnings

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.net.selector import NetworkSelector
    from kafka.net.transport import KafkaTCPTransport

from pipeline.queue.kafka_transport import install_eager_writes


def _pair() -> tuple[NetworkSelector, KafkaTCPTransport, socket.socket]:
    a, b = socket.socketpair()
    a.setblocking(False)
    b.setblocking(False)
    net = NetworkSelector()
    return net, KafkaTCPTransport(net, a, host="peer"), b


def _read_all(sock: socket.socket) -> bytes:
    out = b""
    while True:
        try:
            chunk = sock.recv(1 << 20)
        except BlockingIOError:
            return out
        if not chunk:
            return out
        out += chunk


def test_a_request_is_on_the_wire_without_an_event_loop_turn():
    install_eager_writes()
    net, t, peer = _pair()
    try:
        t.write(b"request-1")
        assert _read_all(peer) == b"request-1"  # nothing ran the loop
        assert not t._write_buffer and not t._writing
    finally:
        net.close()
        peer.close()


def test_what_the_socket_does_not_take_is_queued_in_order():
    install_eager_writes()
    net, t, peer = _pair()
    try:
        big = bytes(range(256)) * 40_000  # 10 MB: more than a socket buffer holds
        t.write(big)
        t.write(b"tail")  # queued behind the rest, never sent ahead of it
        assert t._writing and t._write_buffer
        got = b""
        while len(got) < len(big) + 4:
            net.poll(timeout_ms=10)
            got += _read_all(peer)
        assert got == big + b"tail"
    finally:
        net.close()
        peer.close()
