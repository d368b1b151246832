"""ix_jobs_updated_at: the rows written since a time, an index range (the API's metrics read the
jobs that succeeded since their last reading: TTFT histogram, prefix-cache hits)

Revision ID: 0008
Revises: 0007
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_updated_at", "jobs", ["updated_at"])


def downgrade() -> None:
    op.drop_index("ix_jobs_updated_at", table_name="jobs")
