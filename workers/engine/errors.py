"""Errors the engine raises for one request (the engine itself keeps serving the others)."""

from __future__ import annotations

from schemas.job import ErrorCode


class InvalidRequestError(ValueError):
    """A request the engine refuses; `code` is the job's ErrorCode (the one set of codes the
    submission checks, the engine and the stored rows share)."""

    def __init__(self, code: ErrorCode, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded (missing file, unsupported architecture, bad dtype)."""
