"""The results database's tables, as SQLAlchemy Core metadata.

These definitions are what the store's queries are written against; the schema itself is created
and changed only by the Alembic migrations under migrations/, which must agree with this file
(tests/pipeline/store/test_store_sqlite.py checks that they do).
"""

from __future__ import annotations

from sqlalchemy import (
    JSON,
    BigInteger,
    Column,
    Float,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Table,
    Text,
)
from sqlalchemy.dialects.postgresql import JSONB

metadata = MetaData()

# JSON on SQLite, JSONB on Postgres (indexable, compact, queryable with ->> in SQL).
JsonDoc = JSON().with_variant(JSONB(), "postgresql")

ID_LEN = 200

jobs = Table(
    "jobs",
    metadata,
    # firsttoken's job id: derived from (batch, custom_id) for a batch's jobs (schemas.job)
    Column("id", String(ID_LEN), primary_key=True),
    Column("batch_id", String(ID_LEN), nullable=True),
    Column("status", String(16), nullable=False),
    # the client's id, who submitted it, and where in its batch's input it came from
    Column("custom_id", String(ID_LEN), nullable=True),
    Column("owner", String(ID_LEN), nullable=True),
    Column("line_no", Integer, nullable=True),
    Column("line_format", String(32), nullable=True),
    # the request (null when a result arrives for a job that was never recorded as queued)
    Column("prompt", Text, nullable=True),
    Column("messages", JsonDoc, nullable=True),
    Column("sampling", JsonDoc, nullable=True),
    Column("priority", Integer, nullable=False, server_default="0"),
    Column("prefix_key", String(ID_LEN), nullable=True),
    Column("metadata", JsonDoc, nullable=True),
    # the result
    Column("text", Text, nullable=True),
    Column("finish_reason", String(16), nullable=True),
    Column("prompt_tokens", Integer, nullable=True),
    Column("cached_prompt_tokens", Integer, nullable=True),
    Column("completion_tokens", Integer, nullable=True),
    # instants: epoch seconds; durations: milliseconds (see schemas.job.JobTimings)
    Column("submitted_at", Float, nullable=True),
    Column("admitted_at", Float, nullable=True),
    Column("first_token_at", Float, nullable=True),
    Column("finished_at", Float, nullable=True),
    Column("queue_ms", Float, nullable=True),
    Column("ttft_ms", Float, nullable=True),
    Column("engine_ttft_ms", Float, nullable=True),
    Column("prefill_ms", Float, nullable=True),
    Column("tpot_ms", Float, nullable=True),
    Column("e2e_ms", Float, nullable=True),
    Column("worker", String(ID_LEN), nullable=True),
    Column("model", String(ID_LEN), nullable=True),
    Column("error_code", String(32), nullable=True),
    Column("error_message", Text, nullable=True),
    # added by revision 0004: when the engine first ran it, and the pipeline's own part of TTFT
    Column("scheduled_at", Float, nullable=True),
    Column("overhead_ms", Float, nullable=True),
    # added by revision 0006: per output / prompt token, when the job asked for them (JSON lists)
    Column("logprobs", JsonDoc, nullable=True),
    Column("prompt_logprobs", JsonDoc, nullable=True),
    # added by revision 0007: how many times a worker took it into its engine (ResultStore.admit)
    Column("deliveries", Integer, nullable=False, server_default="0"),
    # added by revision 0009: a prompt list (texts and token-id lists; `prompt` is then null), and
    # every choice of a job that has several (text, finish_reason, logprobs: the first choice's)
    Column("prompts", JsonDoc, nullable=True),
    Column("choices", JsonDoc, nullable=True),
    # added by revision 0010: a chat job's tools, tool_choice and parallel_tool_calls (one JSON object)
    Column("tools", JsonDoc, nullable=True),
    # row bookkeeping, epoch seconds
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Index("ix_jobs_batch_status", "batch_id", "status"),
    Index("ix_jobs_status", "status"),
    Index("ix_jobs_submitted_at", "submitted_at"),
    Index("ix_jobs_finished_at", "finished_at"),
    Index("ix_jobs_batch_line", "batch_id", "line_no"),
    Index("ix_jobs_owner", "owner"),
    Index("ix_jobs_owner_status", "owner", "status"),  # revision 0005: an owner's unfinished jobs
    Index("ix_jobs_updated_at", "updated_at"),  # revision 0008: rows written since (the API's metrics)
)

batches = Table(
    "batches",
    metadata,
    Column("id", String(ID_LEN), primary_key=True),
    Column("status", String(16), nullable=False),
    Column("owner", String(ID_LEN), nullable=True),
    # sha256 of the input the batch was made from: the same input again resumes the batch
    Column("input_digest", String(64), nullable=True),
    Column("input_format", String(32), nullable=True),
    Column("source", Text, nullable=True),
    Column("output", Text, nullable=True),
    Column("total_jobs", Integer, nullable=True),
    Column("metadata", JsonDoc, nullable=True),
    Column("created_at", Float, nullable=False),
    Column("updated_at", Float, nullable=False),
    Column("finished_at", Float, nullable=True),
    Index("ix_batches_created_at", "created_at"),
    Index("ix_batches_owner", "owner"),
    Index("ix_batches_owner_created", "owner", "created_at"),
)

# Uploaded input files (POST /v1/files, purpose "batch"). A batch's output and error files are
# not stored: they are its rows, read in input order when asked for.
files = Table(
    "files",
    metadata,
    Column("id", String(64), primary_key=True),
    Column("owner", String(ID_LEN), nullable=True),
    Column("purpose", String(32), nullable=False),
    Column("filename", Text, nullable=False),
    Column("bytes", BigInteger, nullable=False),
    Column("sha256", String(64), nullable=False),
    Column("content", LargeBinary, nullable=False),
    Column("created_at", Float, nullable=False),
    Index("ix_files_owner_created", "owner", "created_at"),
)

# Columns a result writes; the request columns are written only when the row is first inserted.
RESULT_COLUMNS = (
    "status",
    "text",
    "finish_reason",
    "prompt_tokens",
    "cached_prompt_tokens",
    "completion_tokens",
    "submitted_at",
    "admitted_at",
    "scheduled_at",
    "first_token_at",
    "finished_at",
    "queue_ms",
    "overhead_ms",
    "ttft_ms",
    "engine_ttft_ms",
    "prefill_ms",
    "tpot_ms",
    "e2e_ms",
    "worker",
    "model",
    "error_code",
    "error_message",
    "logprobs",
    "prompt_logprobs",
    "choices",
)

LATENCY_METRICS = ("queue_ms", "overhead_ms", "ttft_ms", "engine_ttft_ms", "prefill_ms", "tpot_ms", "e2e_ms")
