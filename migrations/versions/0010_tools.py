"""jobs.tools: a chat job's tools, tool_choice and parallel_tool_calls (one JSON object; JSONB
on Postgres), kept so that its output is read into tool calls wherever it is shown (a batch's
output file, a job read again)

Revision ID: 0010
Revises: 0009
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# a plain ADD / DROP COLUMN (SQLite has both): a batch table copy would break the job_latency view


def upgrade() -> None:
    op.add_column("jobs", sa.Column("tools", sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))


def downgrade() -> None:
    op.drop_column("jobs", "tools")
