"""files: the inputs uploaded through POST /v1/files (purpose "batch"), owned like jobs

Revision ID: 0003
Revises: 0002
Create Date: 2026-12-01
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "files",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("owner", sa.String(200), nullable=True),
        sa.Column("purpose", sa.String(32), nullable=False),
        sa.Column("filename", sa.Text, nullable=False),
        sa.Column("bytes", sa.BigInteger, nullable=False),
        sa.Column("sha256", sa.String(64), nullable=False),
        sa.Column("content", sa.LargeBinary, nullable=False),
        sa.Column("created_at", sa.Float, nullable=False),
    )
    op.create_index("ix_files_owner_created", "files", ["owner", "created_at"])
    op.create_index("ix_batches_owner_created", "batches", ["owner", "created_at"])


def downgrade() -> None:
    op.drop_index("ix_batches_owner_created", "batches")
    op.drop_index("ix_files_owner_created", "files")
    op.drop_table("files")
