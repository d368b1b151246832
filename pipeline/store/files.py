"""Uploaded files (the OpenAI files API): metadata and content."""

from __future__ import annotations

from sqlalchemy import and_, delete, or_, select

from pipeline.store.records import FileRecord
from pipeline.store.rows import StoreBase
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

    def list_files(
        self, *, owner: str | None = None, purpose: str | None = None, limit: int = 100, after: str | None = None,
        newest_first: bool = True,
    ) -> list[FileRecord]:
        """Files (of one owner when given, of one purpose when given), by creation time; `after` is
        the last id of the previous page: another owner's id is as a missing one (an empty page)."""
        cols = [c for c in files.c if c.name != "content"]
        order = (files.c.created_at.desc(), files.c.id.desc()) if newest_first else (files.c.created_at, files.c.id)
        q = select(*cols).order_by(*order).limit(limit)
        if owner is not None:
            q = q.where(files.c.owner == owner)
        if purpose is not None:
            q = q.where(files.c.purpose == purpose)
        with self.engine.connect() as conn:
            if after is not None:
                cursor = select(files.c.created_at).where(files.c.id == after)
                if owner is not None:
                    cursor = cursor.where(files.c.owner == owner)
                last = conn.execute(cursor).scalar()
                if last is None:
                    return []
                if newest_first:
                    q = q.where(or_(files.c.created_at < last, and_(files.c.created_at == last, files.c.id < after)))
                else:
                    q = q.where(or_(files.c.created_at > last, and_(files.c.created_at == last, files.c.id > after)))
            return [FileRecord(**row._mapping) for row in conn.execute(q)]

    def delete_file(self, file_id: str) -> bool:
        """Delete a file; False when there was none."""
        with self.engine.begin() as conn:
            return conn.execute(delete(files).where(files.c.id == file_id)).rowcount > 0
