"""The backing services that scripts/services.sh starts refuse clients without their credentials
(Kafka SASL/PLAIN on its listener, Postgres password authentication, a Redis password), and the
project's clients, built from the settings, get in with them: every other integration test runs
through these same credentials."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from kafka import KafkaAdminClient
from kafka.errors import KafkaError
from sqlalchemy import create_engine, text
from sqlalchemy.engine import URL, make_url
from sqlalchemy.exc import OperationalError

from pipeline.queue.kafka import KafkaQueue
from pipeline.settings import Settings

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
KAFKA_LOG = Path(os.environ.get("FIRSTTOKEN_SERVICES_DIR", ROOT / ".services")) / "kafka" / "server.log"


def _admin(**config) -> list[str]:
    admin = KafkaAdminClient(**config, bootstrap_timeout_ms=4000, request_timeout_ms=4000)
    try:
        return admin.list_topics()
    finally:
        admin.close()


def test_kafka_takes_only_sasl_clients_with_the_password(kafka_settings: Settings):
    good = kafka_settings.kafka_client_config
    assert good["security_protocol"] == "SASL_PLAINTEXT", (
        "the test Kafka has no credentials (started before scripts/services.sh gave it SASL?): "
        "restart it with scripts/services.sh stop kafka && scripts/services.sh start kafka"
    )
    KafkaQueue(kafka_settings).close()  # the project's clients (admin, producer) get in
    assert kafka_settings.jobs_topic in _admin(**good)
    log_before = KAFKA_LOG.stat().st_size if KAFKA_LOG.exists() else 0

    # no SASL at all: the listener answers no request of a client that does not authenticate
    with pytest.raises(KafkaError):
        _admin(bootstrap_servers=good["bootstrap_servers"])
    # SASL with a wrong password: authentication fails (and the broker says so in its log)
    with pytest.raises(KafkaError):
        _admin(**{**good, "sasl_plain_password": "not-the-password"})
    with pytest.raises(KafkaError):
        _admin(**{**good, "sasl_plain_username": "someone-else"})
    if KAFKA_LOG.exists():
        deadline = time.monotonic() + 10
        while True:
            with KAFKA_LOG.open("rb") as f:
                f.seek(log_before)
                tail = f.read().decode(errors="replace")
            if "Invalid username or password" in tail or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert "Invalid username or password" in tail
        assert good["sasl_plain_password"] not in tail  # the broker never logs the password


def test_settings_refuse_half_credentials():
    with pytest.raises(ValueError, match="go together"):
        Settings(kafka_username="firsttoken", kafka_password=None)
    with pytest.raises(ValueError, match="needs kafka_username"):
        Settings(kafka_username=None, kafka_password=None, kafka_security_protocol="SASL_PLAINTEXT")
    plain = Settings(kafka_username=None, kafka_password=None).kafka_client_config
    assert plain["security_protocol"] == "PLAINTEXT" and "sasl_plain_password" not in plain


def test_postgres_takes_only_the_password(postgres_server_url: str):
    url = make_url(postgres_server_url)
    assert url.password, "the test Postgres has no password (a data directory made before credentials?)"
    ok = create_engine(url)
    with ok.connect() as conn:
        assert conn.execute(text("select 1")).scalar() == 1
    ok.dispose()
    # (URL.set(password=None) keeps the password: build the URL without one)
    bare = URL.create(url.drivername, username=url.username, host=url.host, port=url.port, database=url.database)
    for bad in (bare, url.set(password="not-the-password")):
        engine = create_engine(bad, connect_args={"connect_timeout": 5})
        with pytest.raises(OperationalError) as info:
            engine.connect()
        assert "password" in str(info.value)
        engine.dispose()


def test_redis_takes_only_the_password(redis_url: str):
    import redis

    assert make_url(redis_url.replace("redis://", "postgresql://", 1)).password, "the test Redis has no password"
    assert redis.Redis.from_url(redis_url).ping()
    host_port = redis_url.split("@", 1)[1]
    for bad in (f"redis://{host_port}", f"redis://:not-the-password@{host_port}"):
        client = redis.Redis.from_url(bad, socket_connect_timeout=5)
        with pytest.raises(redis.AuthenticationError):
            client.ping()
        client.close()


def test_no_kafka_client_logs_the_password(kafka_settings: Settings, caplog):
    """kafka-python logs at DEBUG the admin client's configuration, each request and its raw bytes
    (the SASL authentication's too): the password is in none of them, and its warning that
    SASL/PLAIN sends the password in the clear comes once, not on every connection."""
    import logging

    password = kafka_settings.kafka_client_config["sasl_plain_password"]
    with caplog.at_level(logging.DEBUG):
        for _ in range(2):
            q = KafkaQueue(kafka_settings)
            q.publish([])
            q.close()
    text = "\n".join(r.getMessage() for r in caplog.records)
    assert "Starting KafkaAdminClient with configuration" in text and "SaslAuthenticateRequest" in text
    assert password not in text and "'sasl_plain_password': '***'" in text
    assert text.count("Sending username and password in the clear") <= 1
