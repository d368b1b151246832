"""Uploaded files (the OpenAI files API): metadata and content."""

from __future__ import annotations

from sqlalchemy import (
    select,
)

from pipeline.store.records import (
    FileRecord,
)
from pipeline.store.rows import (
    StoreBase,
)
from pipeline.store.tables import files


class Files(StoreBase):
    """The `files` table."""

    def put_file(self, file_id: str, *, owner: str | None, purpose: str, filename: str, content: bytes) -> FileRecord:
        """Store an uploaded file."""
        import hashlib

        rec = FileRecord(
            id=file_id,
            owner=owner,
            purpose=purpose,
            filename=filename,
            bytes=len(content),
            sha256=hashlib.sha256(content).hexdigest(),
            created_at=self._clock(),
        )
        with self.engine.begin() as conn:
            conn.execute(files.insert().values(**rec.__dict__, content=content))
        return rec

    def get_file(self, file_id: str) -> FileRecord | None:
        """A file's record (not its content), or None."""
        cols = [c for c in files.c if c.name != "content"]
        with self.engine.connect() as conn:
            row = conn.execute(select(*cols).where(files.c.id == file_id)).first()
        return None if row is None else FileRecord(**row._mapping)

    def file_content(self, file_id: str) -> bytes | None:
        """A file's bytes, or None."""
        with self.engine.connect() as conn:
            return conn.execute(select(files.c.content).where(files.c.id == file_id)).scalar()
