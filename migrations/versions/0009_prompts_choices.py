"""jobs.prompts and jobs.choices: a completions job's prompt list (texts and token-id lists), and
every choice of a job that has several (a prompt list, n, best_of); JSON, JSONB on Postgres

Revision ID: 0009
Revises: 0008
Create Date: 2026-12-02
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# a plain ADD / DROP COLUMN (SQLite has both): a batch table copy would break the job_latency view


def upgrade() -> None:
    for name in ("prompts", "choices"):
        op.add_column("jobs", sa.Column(name, sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))


def downgrade() -> None:
    for name in ("choices", "prompts"):
        op.drop_column("jobs", name)
