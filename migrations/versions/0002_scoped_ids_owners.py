"""job identity is (batch, custom id); owners; line numbers; batch input digests

A job's `id` stays the primary key every writer upserts by, but new jobs get ids derived from
(batch, the client's custom id), so the same custom id in two batches is two jobs. The client's
id moves to `custom_id` (existing rows: their id, which was the client's), `line_no` and
`line_format` place a job in its batch's input (results come back in input order, in the input's
format), `owner` is the API key's owner of jobs and batches, and `input_digest` names the input a
batch was made from (submitting it again resumes it; another input under its id is refused).

Revision ID: 0002
Revises: 0001
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _latency_view_sql(dialect: str, ids: str = "id, batch_id, custom_id, owner") -> str:
    # One row per finished job: its latencies, where it ran, and how much of its prompt was cached.
    # pipeline_overhead_ms = what the user waited for the first token beyond the engine's own TTFT.
    if dialect == "postgresql":
        ts = "to_timestamp({})"
    else:
        ts = "strftime('%Y-%m-%d %H:%M:%f', {}, 'unixepoch')"
    return f"""
        CREATE VIEW job_latency AS
        SELECT
            {ids}, status, worker, model, error_code,
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
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS job_latency")
    with op.batch_alter_table("jobs") as t:
        t.add_column(sa.Column("custom_id", sa.String(200), nullable=True))
        t.add_column(sa.Column("owner", sa.String(200), nullable=True))
        t.add_column(sa.Column("line_no", sa.Integer, nullable=True))
        t.add_column(sa.Column("line_format", sa.String(32), nullable=True))
    op.execute("UPDATE jobs SET custom_id = id WHERE custom_id IS NULL")
    op.create_index("ix_jobs_batch_line", "jobs", ["batch_id", "line_no"])
    op.create_index("ix_jobs_owner", "jobs", ["owner"])
    with op.batch_alter_table("batches") as t:
        t.add_column(sa.Column("owner", sa.String(200), nullable=True))
        t.add_column(sa.Column("input_digest", sa.String(64), nullable=True))
    op.create_index("ix_batches_owner", "batches", ["owner"])
    op.execute(_latency_view_sql(dialect))


def downgrade() -> None:
    dialect = op.get_bind().dialect.name
    op.execute("DROP VIEW IF EXISTS job_latency")
    op.drop_index("ix_batches_owner", "batches")
    with op.batch_alter_table("batches") as t:
        t.drop_column("input_digest")
        t.drop_column("owner")
    op.drop_index("ix_jobs_owner", "jobs")
    op.drop_index("ix_jobs_batch_line", "jobs")
    with op.batch_alter_table("jobs") as t:
        t.drop_column("line_format")
        t.drop_column("line_no")
        t.drop_column("owner")
        t.drop_column("custom_id")
    op.execute(_latency_view_sql(dialect, ids="id, batch_id"))  # revision 0001's view
