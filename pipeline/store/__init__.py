"""The results store: jobs and batches in Postgres or SQLite, schema by Alembic migrations."""

from pipeline.store.engine import make_engine, refused_data
from pipeline.store.migrate import migrate
from pipeline.store.records import (
    BatchProgress,
    BatchRecord,
    BatchStatus,
    FileRecord,
    JobRecord,
    LatencyStats,
)
from pipeline.store.repository import ResultStore, percentile_cont

__all__ = [
    "BatchProgress",
    "BatchRecord",
    "BatchStatus",
    "FileRecord",
    "JobRecord",
    "LatencyStats",
    "ResultStore",
    "make_engine",
    "migrate",
    "percentile_cont",
    "refused_data",
]
