"""Files, as the OpenAI Batch API has them: upload a batch's input (`POST /v1/files`, purpose
"batch"), read it back, and read a batch's output and error files (`file-output-<batch>`,
`file-errors-<batch>`: its succeeded, and its failed or cancelled, lines in input order, made
from its rows when asked for)."""

from __future__ import annotations

from fastapi import APIRouter, Request
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


@router.get("/v1/files/{file_id}", response_model=FileView)
def get_file(file_id: str, who: Who, state: State) -> FileView:
    """An uploaded file's description, or a batch's output or error file's."""
    gen = _generated(state, who, file_id)
    if gen is not None:
        b = gen[0]
        return FileView(id=file_id, bytes=0, created_at=int(b.finished_at or b.created_at),
                        filename=f"{file_id}.jsonl", purpose="batch_output")
    f = state.st.get_file(file_id)
    if f is None or not who.may_see(f.owner):
        raise ApiError(404, "not_found", "no such file")
    return _view(f)


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
