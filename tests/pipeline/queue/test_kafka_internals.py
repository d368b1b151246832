"""kafka-python's internals in one module (pipeline.queue.kafka_internals): its version checked, no
other module reaching in, and the eager writes of its TCP transport."""

from __future__ import annotations

import socket
import warnings

import pytest

with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    from kafka.net.selector import NetworkSelector
    from kafka.net.transport import KafkaTCPTransport

from pipeline.queue.kafka_internals import KAFKA_PYTHON_VERSION, check_version, install_eager_writes


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


def test_the_pinned_kafka_python_is_the_one_installed_and_checked():
    """pyproject.toml pins kafka-python to exactly the version kafka_internals was written for,
    and another version fails at import with an error that says what to install."""
    import tomllib
    from pathlib import Path

    import kafka

    deps = tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]["dependencies"]
    pins = [d for d in deps if d.startswith("kafka-python")]
    assert pins == [f"kafka-python[crc32c]=={KAFKA_PYTHON_VERSION}"]
    assert kafka.__version__ == KAFKA_PYTHON_VERSION
    check_version()
    with pytest.raises(RuntimeError, match=rf"kafka-python 3\.1\.0 is installed.*install kafka-python=={KAFKA_PYTHON_VERSION}"):
        check_version("3.1.0")


def test_kafka_pythons_internals_are_reached_from_one_module_only():
    """No module but pipeline/queue/kafka_internals.py touches a private attribute of a
    kafka-python object or imports kafka.net (kafka-python's internal IO layer)."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    private = {"_accumulator", "_sender", "_coordinator", "_transaction_manager", "_builder", "_next_offset",
               "_appends_in_progress", "_tp_lock", "_incomplete", "_write_buffer", "_writing", "_sock",
               "_client", "_fetcher", "_subscription", "_manager", "_net"}
    offenders = []
    for path in [*root.glob("pipeline/**/*.py"), *root.glob("workers/**/*.py"), *root.glob("firsttoken/**/*.py")]:
        if path.name == "kafka_internals.py":
            continue
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in private and not (
                isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
            ):
                offenders.append(f"{path.relative_to(root)}:{node.lineno} .{node.attr}")
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("kafka.net"):
                offenders.append(f"{path.relative_to(root)}:{node.lineno} from {node.module}")
    assert offenders == []


def test_the_password_filter_redacts_and_never_raises_on_a_malformed_record():
    import logging

    from pipeline.queue.kafka import _NoPasswords

    _NoPasswords.secrets.add("s3cret-for-the-filter-test")
    f = _NoPasswords()
    ok = logging.LogRecord("kafka.net.connection", logging.DEBUG, __file__, 1, "auth %s", ("x s3cret-for-the-filter-test",), None)
    assert f.filter(ok) and ok.getMessage() == "auth x ***"
    bad = logging.LogRecord("kafka.net.connection", logging.DEBUG, __file__, 1, "two %s %s", ("one",), None)
    assert f.filter(bad)  # left for the handler to report, not raised into kafka-python's call


def test_membership_says_whether_the_client_still_has_its_member_id():
    """The watchdog's log line names the client's generation and whether it kept its member id (a client
    that lost it rejoins as a new member, and the rebalance waits for the old one's session)."""
    from types import SimpleNamespace

    from kafka.coordinator.base import Generation

    from pipeline.queue.kafka_internals import membership

    def consumer(gen):
        return SimpleNamespace(_coordinator=SimpleNamespace(_generation=gen))

    assert membership(consumer(Generation(7, "member-1", "range"))) == "generation 7, member id kept"
    assert membership(consumer(Generation.NO_GENERATION)) == "generation -1, member id lost"
    assert membership(SimpleNamespace()) == "no coordinator"
