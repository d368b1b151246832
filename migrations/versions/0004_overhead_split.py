"""timings: scheduled_at and overhead_ms; the latency view's pipeline_overhead_ms leaves out queue wait

queue_ms is now the waiting for capacity (back-pressure in Kafka, then the engine's waiting
queue) and overhead_ms the pipeline's own part of TTFT (submission to admission, less the
back-pressure wait). job_latency.pipeline_overhead_ms is overhead_ms; rows written before this
revision keep the old difference (ttft_ms - engine_ttft_ms).

Revision ID: 0004
Revises: 0003
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0004"
down_revision: str | None = "0003"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def _view(dialect: str, *, split: bool) -> str:
    ts = "to_timestamp({})" if dialect == "postgresql" else "strftime('%Y-%m-%d %H:%M:%f', {}, 'unixepoch')"
    overhead = "COALESCE(overhead_ms, ttft_ms - engine_ttft_ms)" if split else "ttft_ms - engine_ttft_ms"
    extra = "scheduled_at, overhead_ms," if split else ""
    return f"""
        CREATE VIEW job_latency AS
        SELECT
            id, batch_id, custom_id, owner, status, worker, model, error_code,
            {ts.format("submitted_at")} AS submitted_time,
            {ts.format("finished_at")} AS finished_time,
            submitted_at, finished_at, {extra}
            queue_ms, ttft_ms, engine_ttft_ms, prefill_ms, tpot_ms, e2e_ms,
            {overhead} AS pipeline_overhead_ms,
            prompt_tokens, cached_prompt_tokens, completion_tokens
        FROM jobs
        WHERE finished_at IS NOT NULL
    """


def upgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_latency")
    with op.batch_alter_table("jobs") as t:
        t.add_column(sa.Column("scheduled_at", sa.Float, nullable=True))
        t.add_column(sa.Column("overhead_ms", sa.Float, nullable=True))
    op.execute(_view(op.get_bind().dialect.name, split=True))


def downgrade() -> None:
    op.execute("DROP VIEW IF EXISTS job_latency")
    with op.batch_alter_table("jobs") as t:
        t.drop_column("overhead_ms")
        t.drop_column("scheduled_at")
    op.execute(_view(op.get_bind().dialect.name, split=False))
