"""Files, as the OpenAI Batch API has them: upload a batch's input (`POST /v1/files`, purpose
"batch"), list (`GET /v1/files`), read back and delete the caller's files, and read a batch's
output and error files (`file-output-<batch>`, `file-errors-<batch>`: its succeeded, and its
failed or cancelled, lines in input order, made from its rows when asked for; their `bytes` are
counted once the batch has ended, and kept with it)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import FormData
from starlette.formparsers import MultiPartParser

from firsttoken.api.batches import ERRORS_PREFIX, OUTPUT_PREFIX
from firsttoken.api.deps import ApiError, ApiState, Principal, State, Who, limited_stream
from firsttoken.api.edge import clean_text
from pipeline.batch_io import batch_format, result_lines
from pipeline.store import BatchRecord, FileRecord
from schemas.job import ErrorCode, JobStatus, new_job_id

router = APIRouter(tags=["files"])


class FileView(BaseModel):
    """An OpenAI File object."""

    id: str
    object: str = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str = "processed"
    status_details: str | None = None
    expires_at: int | None = None


def _view(f: FileRecord) -> FileView:
    return FileView(id=f.id, bytes=f.bytes, created_at=int(f.created_at), filename=f.filename, purpose=f.purpose)


MULTIPART_OVERHEAD = 64 * 1024  # the form's other fields and part headers, beside the file itself


@router.post("/v1/files", response_model=FileView)
async def upload(request: Request, who: Who, state: State) -> FileView:
    """Store an uploaded batch input (multipart: `file`, `purpose=batch`). The bytes received are
    counted as they arrive, chunked or not: past the limit reading stops with 413."""
    limit = state.settings.api_max_batch_bytes
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit + MULTIPART_OVERHEAD:
        raise ApiError(413, ErrorCode.TOO_LARGE, f"the upload is over the limit of {limit} bytes",
                       headers={"Connection": "close"})
    parser = MultiPartParser(request.headers, limited_stream(request, limit + MULTIPART_OVERHEAD),
                             max_files=1, max_fields=8)
    try:
        form = await parser.parse()
    except ApiError:
        raise
    except Exception as exc:
        raise ApiError(400, ErrorCode.INVALID_REQUEST, f"send a multipart form ({type(exc).__name__})") from None
    try:
        return await _store_upload(state, who, form, limit)
    finally:
        await form.close()


async def _store_upload(state: ApiState, who: Principal, form: FormData, limit: int) -> FileView:
    purpose, upload_ = form.get("purpose"), form.get("file")
    if purpose != "batch":
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "purpose: only 'batch' files are supported")
    if upload_ is None or isinstance(upload_, str):
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "file: missing (a multipart file field)")
    name = upload_.filename or "input.jsonl"
    if not clean_text(name):
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "file: its name holds a NUL or a lone surrogate")
    content = await upload_.read(limit + 1)
    if len(content) > limit:
        raise ApiError(413, ErrorCode.TOO_LARGE, f"the file is over the limit of {limit} bytes")
    rec = await run_in_threadpool(
        state.st.put_file, f"file-{new_job_id()}", owner=who.owner, purpose="batch", filename=name[:255],
        content=content
    )
    return _view(rec)


def _generated(state: ApiState, who: Principal, file_id: str) -> tuple[BatchRecord, set[JobStatus]] | None:
    """(the batch, the statuses of its lines) of a batch's output or error file id, or None."""
    for prefix, statuses in (
        (OUTPUT_PREFIX, {JobStatus.SUCCEEDED}),
        (ERRORS_PREFIX, {JobStatus.FAILED, JobStatus.CANCELLED}),
    ):
        if file_id.startswith(prefix):
            return state.find_batch(who, file_id[len(prefix) :]), statuses
    return None


class FileList(BaseModel):
    object: str = "list"
    data: list[FileView]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool = False


class FileDeleted(BaseModel):
    id: str
    object: str = "file"
    deleted: bool = True


@router.get("/v1/files", response_model=FileList)
def list_files(
    who: Who,
    state: State,
    purpose: str | None = Query(default=None, max_length=32),
    limit: int = Query(default=100, ge=1, le=10_000),
    after: str | None = Query(default=None, max_length=200),
    order: Literal["asc", "desc"] = "desc",
) -> FileList:
    """The caller's uploaded files, newest first (`order=asc`: oldest first), a page at a time."""
    page = state.st.list_files(owner=who.owner, purpose=purpose, limit=limit + 1, after=after,
                               newest_first=order == "desc")
    data = [_view(f) for f in page[:limit]]
    return FileList(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None,
                    has_more=len(page) > limit)


def _generated_bytes(state: ApiState, b: BatchRecord, file_id: str, statuses: set[JobStatus]) -> int:
    """The size of a batch's output or error file: counted from its lines, and kept in the batch's
    metadata once the batch has ended (its rows never change again)."""
    sizes = b.metadata.get("file_bytes", {}) if isinstance(b.metadata, dict) else {}
    if file_id in sizes:
        return int(sizes[file_id])
    n = sum(len(line.encode()) for line in result_lines(state.st, b.id, batch_format(b.input_format), statuses=statuses))
    if b.status.ended:
        state.st.set_batch_metadata(b.id, {**b.metadata, "file_bytes": {**sizes, file_id: n}})
    return n


@router.get("/v1/files/{file_id}", response_model=FileView)
def get_file(file_id: str, who: Who, state: State) -> FileView:
    """An uploaded file's description, or a batch's output or error file's (with its real size)."""
    gen = _generated(state, who, file_id)
    if gen is not None:
        b, statuses = gen
        return FileView(id=file_id, bytes=_generated_bytes(state, b, file_id, statuses),
                        created_at=int(b.finished_at or b.created_at), filename=f"{file_id}.jsonl",
                        purpose="batch_output")
    f = state.st.get_file(file_id)
    if f is None or not who.may_see(f.owner):
        raise ApiError(404, "not_found", "no such file")
    return _view(f)


@router.delete("/v1/files/{file_id}", response_model=FileDeleted)
def delete_file(file_id: str, who: Who, state: State) -> FileDeleted:
    """Delete one of the caller's uploaded files (a batch made from it keeps its jobs). A batch's
    output and error files are made from its rows: they go with the batch, not alone."""
    if _generated(state, who, file_id) is not None:
        raise ApiError(400, ErrorCode.INVALID_REQUEST, "a batch's output and error files are made from its rows: "
                       "they cannot be deleted alone")
    f = state.st.get_file(file_id)
    if f is None or not who.may_see(f.owner) or not state.st.delete_file(f.id):
        raise ApiError(404, "not_found", "no such file")
    return FileDeleted(id=f.id)


@router.get("/v1/files/{file_id}/content")
def file_content(file_id: str, who: Who, state: State) -> Response:
    """An uploaded file's bytes, or a batch's output or error lines in input order."""
    gen = _generated(state, who, file_id)
    if gen is not None:
        b, statuses = gen
        lines = result_lines(state.st, b.id, batch_format(b.input_format), statuses=statuses)
        return StreamingResponse(lines, media_type="application/jsonl")
    f = state.st.get_file(file_id)
    if f is None or not who.may_see(f.owner):
        raise ApiError(404, "not_found", "no such file")
    return Response(state.st.file_content(f.id) or b"", media_type="application/jsonl")
