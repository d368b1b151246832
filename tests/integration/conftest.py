"""Fixtures for the integration tests: real Kafka, Postgres and Redis from scripts/services.sh.

The services are found through FIRSTTOKEN_KAFKA_BOOTSTRAP, FIRSTTOKEN_DATABASE_URL and
FIRSTTOKEN_REDIS_URL (`eval "$(scripts/services.sh env)"`). When one is missing, its tests skip,
unless FIRSTTOKEN_REQUIRE_SERVICES=1 (scripts/test.sh sets it): then they fail.
"""

from __future__ import annotations

import os
import sys
import uuid
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url

from pipeline.settings import Settings, normalize_database_url

# kafka-python 3.0 loads its protocol schemas with importlib.resources' deprecated API, once, at
# import: import it here with those warnings off, so that they do not flood every report.
with warnings.catch_warnings():
    warnings.simplefilter("ignore", DeprecationWarning)
    import kafka
    import kafka.admin  # noqa: F401

# The store's dialect-independent tests live beside the unit tests.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "pipeline" / "store"))

HINT = 'start them with: scripts/services.sh start && eval "$(scripts/services.sh env)"'


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(item.fspath).parents:
            item.add_marker(pytest.mark.integration)
            # kafka-python 3.0 loads its protocol schemas with importlib.resources' legacy API
            item.add_marker(
                pytest.mark.filterwarnings("ignore::DeprecationWarning:kafka.protocol.schemas.load_json")
            )
            item.add_marker(pytest.mark.filterwarnings("ignore:open_text is deprecated:DeprecationWarning"))


def _required() -> bool:
    return os.environ.get("FIRSTTOKEN_REQUIRE_SERVICES") == "1"


def _missing(message: str) -> None:
    if _required():
        pytest.fail(
            f"{message} (FIRSTTOKEN_REQUIRE_SERVICES=1, so this fails instead of skipping); {HINT}",
            pytrace=False,
        )
    pytest.skip(f"{message}; {HINT}")


def service_env(var: str) -> str:
    """The value of a service variable, or skip/fail the test when it is not set."""
    value = os.environ.get(var, "").strip()
    if not value:
        _missing(f"{var} is not set")
    return value


@pytest.fixture(scope="session")
def kafka_bootstrap() -> str:
    bootstrap = service_env("FIRSTTOKEN_KAFKA_BOOTSTRAP")
    from kafka import KafkaAdminClient
    from kafka.errors import KafkaError

    try:
        KafkaAdminClient(**Settings(kafka_bootstrap=bootstrap).kafka_client_config, request_timeout_ms=10_000).close()
    except KafkaError as exc:
        pytest.fail(f"Kafka at {bootstrap} does not answer: {exc!r}; {HINT}", pytrace=False)
    return bootstrap


@pytest.fixture
def kafka_settings(kafka_bootstrap: str) -> Iterator[Settings]:
    """Settings with fresh topic and group names, so that tests never see each other's messages;
    the topics are deleted afterwards (best effort)."""
    from pipeline.queue.kafka import delete_topics

    tag = uuid.uuid4().hex[:10]
    settings = Settings(
        kafka_bootstrap=kafka_bootstrap,
        jobs_topic=f"test.jobs.{tag}",
        dlq_topic=f"test.jobs.{tag}.dlq",
        consumer_group=f"test-group-{tag}",
        jobs_partitions=4,
        session_timeout_ms=20_000,  # generous: the 2-core CI box runs the JVM, Postgres and torch at once
    )
    yield settings
    try:
        delete_topics(settings, [settings.jobs_topic, settings.dlq_topic], timeout_s=10.0)
    except Exception as exc:  # a test that left the broker down or slow: the topics just stay
        print(f"could not delete the test topics: {exc!r}")


@pytest.fixture(scope="session")
def postgres_server_url() -> str:
    url = normalize_database_url(service_env("FIRSTTOKEN_DATABASE_URL"))
    if make_url(url).get_backend_name() != "postgresql":
        _missing(f"FIRSTTOKEN_DATABASE_URL is not a Postgres URL ({make_url(url).get_backend_name()})")
    return url


@pytest.fixture(scope="session")
def postgres_url(postgres_server_url: str) -> Iterator[str]:
    """A fresh database on the test server for this session, migrated to head, dropped at the end."""
    from pipeline.store import migrate

    server = make_url(postgres_server_url)
    name = f"firsttoken_test_{uuid.uuid4().hex[:12]}"
    admin = create_engine(server.set(database="postgres"), isolation_level="AUTOCOMMIT", pool_pre_ping=True)
    try:
        with admin.connect() as conn:
            conn.execute(text(f'CREATE DATABASE "{name}"'))
    except Exception as exc:
        pytest.fail(
            f"cannot create a test database on {server.render_as_string()}: {exc}; {HINT}", pytrace=False
        )
    url = server.set(database=name).render_as_string(hide_password=False)
    try:
        migrate(url)
        yield url
    finally:
        with admin.connect() as conn:
            conn.execute(text(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)'))
        admin.dispose()


@pytest.fixture(scope="session")
def redis_url() -> str:
    url = service_env("FIRSTTOKEN_REDIS_URL")
    import redis

    try:
        redis.Redis.from_url(url, socket_connect_timeout=5).ping()
    except redis.RedisError as exc:
        where = url.split("@", 1)[-1]  # never the password (scripts/services.sh starts Redis with one)
        pytest.fail(f"Redis at {where} does not answer PING: {type(exc).__name__}; {HINT}", pytrace=False)
    return url
