"""jobs.deliveries: how many times a worker took the job into its engine (a job delivered again
and again without a result is failed instead of run again: it stops the workers that run it)

Revision ID: 0007
Revises: 0006
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0007"
down_revision: str | None = "0006"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# a plain ADD / DROP COLUMN (SQLite has both): a batch table copy would break the job_latency view


def upgrade() -> None:
    op.add_column("jobs", sa.Column("deliveries", sa.Integer(), nullable=False, server_default="0"))


def downgrade() -> None:
    op.drop_column("jobs", "deliveries")
