"""Suite-wide settings.

CPU runs use Triton's interpreter, selected before anything imports triton: transformers may
import it, and a triton imported without the flag cannot interpret later. On a GPU machine set
FIRSTTOKEN_GPU_TESTS=1 to compile the kernels for the device instead.
"""

from __future__ import annotations

import os

if os.environ.get("FIRSTTOKEN_GPU_TESTS") != "1":
    os.environ.setdefault("TRITON_INTERPRET", "1")


import pytest


@pytest.fixture(scope="session")
def sqlite_url(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A migrated SQLite results database shared by the unit suites (emptied after each test)."""
    from pipeline.store import migrate

    url = f"sqlite:///{tmp_path_factory.mktemp('store') / 'results.db'}"
    migrate(url)
    return url


@pytest.fixture
def store(sqlite_url: str):
    """A ResultStore on the SQLite database; the integration suite overrides it with Postgres."""
    from sqlalchemy import text

    from pipeline.store import ResultStore, make_engine

    s = ResultStore(make_engine(sqlite_url))
    yield s
    with s.engine.begin() as conn:
        conn.execute(text("DELETE FROM jobs"))
        conn.execute(text("DELETE FROM batches"))
    s.close()
