"""jobs: an index on (owner, status), so an owner's unfinished jobs are counted from the index
(the API's per-owner limit, FIRSTTOKEN_API_MAX_UNFINISHED_JOBS, counts them at each submission)

Revision ID: 0005
Revises: 0004
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

from alembic import op

revision: str = "0005"
down_revision: str | None = "0004"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_index("ix_jobs_owner_status", "jobs", ["owner", "status"])


def downgrade() -> None:
    op.drop_index("ix_jobs_owner_status", table_name="jobs")
