"""jobs.logprobs and jobs.prompt_logprobs: each output (prompt) token's log-probability and the
top alternatives, for jobs that asked for them (JSON; JSONB on Postgres)

Revision ID: 0006
Revises: 0005
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects.postgresql import JSONB

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


# a plain ADD / DROP COLUMN (SQLite has both): a batch table copy would break the job_latency view


def upgrade() -> None:
    for name in ("logprobs", "prompt_logprobs"):
        op.add_column("jobs", sa.Column(name, sa.JSON().with_variant(JSONB(), "postgresql"), nullable=True))


def downgrade() -> None:
    for name in ("prompt_logprobs", "logprobs"):
        op.drop_column("jobs", name)
