"""Errors the engine raises for one request (the engine itself keeps serving the others)."""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request the engine refuses; `code` is a stable machine-readable error code."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


class CheckpointError(RuntimeError):
    """A checkpoint directory that cannot be loaded (missing file, unsupported architecture, bad dtype)."""
