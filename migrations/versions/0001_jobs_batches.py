"""jobs and batches tables, their indexes, and the job_latency view

Revision ID: 0001
Revises:
Create Date: 2026-11-30
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0001"
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None

JsonDoc = sa.JSON().with_variant(JSONB(), "postgresql")


def _latency_view_sql(dialect: str) -> str:
    # One row per finished job: its latencies, where it ran, and how much of its prompt was cached.
    # pipeline_overhead_ms = what the user waited for the first token beyond the engine's own TTFT.
    if dialect == "postgresql":
        ts = "to_timestamp({})"
    else:
        ts = "strftime('%Y-%m-%d %H:%M:%f', {}, 'unixepoch')"
    return f"""
        CREATE VIEW job_latency AS
        SELECT
            id, batch_id, status, worker, model, error_code,
            {ts.format("submitted_at")} AS submitted_time,
            {ts.format("finished_at")} AS finished_time,
            submitted_at, finished_at,
            queue_ms, ttft_ms, engine_ttft_ms, prefill_ms, tpot_ms, e2e_ms,
            ttft_ms - engine_ttft_ms AS pipeline_overhead_ms,
            prompt_tokens, cached_prompt_tokens, completion_tokens
        FROM jobs
        WHERE finished_at IS NOT NULL
    """


def upgrade() -> None:
    op.create_table(
        "jobs",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("batch_id", sa.String(200), nullable=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("prompt", sa.Text, nullable=True),
        sa.Column("messages", JsonDoc, nullable=True),
        sa.Column("sampling", JsonDoc, nullable=True),
        sa.Column("priority", sa.Integer, nullable=False, server_default="0"),
        sa.Column("prefix_key", sa.String(200), nullable=True),
        sa.Column("metadata", JsonDoc, nullable=True),
        sa.Column("text", sa.Text, nullable=True),
        sa.Column("finish_reason", sa.String(16), nullable=True),
        sa.Column("prompt_tokens", sa.Integer, nullable=True),
        sa.Column("cached_prompt_tokens", sa.Integer, nullable=True),
        sa.Column("completion_tokens", sa.Integer, nullable=True),
        sa.Column("submitted_at", sa.Float, nullable=True),
        sa.Column("admitted_at", sa.Float, nullable=True),
        sa.Column("first_token_at", sa.Float, nullable=True),
        sa.Column("finished_at", sa.Float, nullable=True),
        sa.Column("queue_ms", sa.Float, nullable=True),
        sa.Column("ttft_ms", sa.Float, nullable=True),
        sa.Column("engine_ttft_ms", sa.Float, nullable=True),
        sa.Column("prefill_ms", sa.Float, nullable=True),
        sa.Column("tpot_ms", sa.Float, nullable=True),
        sa.Column("e2e_ms", sa.Float, nullable=True),
        sa.Column("worker", sa.String(200), nullable=True),
        sa.Column("model", sa.String(200), nullable=True),
        sa.Column("error_code", sa.String(32), nullable=True),
        sa.Column("error_message", sa.Text, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
    )
    op.create_index("ix_jobs_batch_status", "jobs", ["batch_id", "status"])
    op.create_index("ix_jobs_status", "jobs", ["status"])
    op.create_index("ix_jobs_submitted_at", "jobs", ["submitted_at"])
    op.create_index("ix_jobs_finished_at", "jobs", ["finished_at"])

    op.create_table(
        "batches",
        sa.Column("id", sa.String(200), primary_key=True),
        sa.Column("status", sa.String(16), nullable=False),
        sa.Column("input_format", sa.String(32), nullable=True),
        sa.Column("source", sa.Text, nullable=True),
        sa.Column("output", sa.Text, nullable=True),
        sa.Column("total_jobs", sa.Integer, nullable=True),
        sa.Column("metadata", JsonDoc, nullable=True),
        sa.Column("created_at", sa.Float, nullable=False),
        sa.Column("updated_at", sa.Float, nullable=False),
        sa.Column("finished_at", sa.Float, nullable=True),
    )
    op.create_index("ix_batches_created_at", "batches", ["created_at"])

    op.execute(_latency_view_sql(op.get_bind().dialect.name))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_latency")
    op.drop_table("batches")
    op.drop_table("jobs")
