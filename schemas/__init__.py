"""Pydantic contracts shared by every side of firsttoken (imports nothing of ours)."""

from schemas.job import (
    TERMINAL_STATUSES,
    ChatMessage,
    ErrorCode,
    FinishReason,
    JobRequest,
    JobResult,
    JobStatus,
    JobTimings,
    Usage,
)
from schemas.sampling import SamplingParams

__all__ = [
    "TERMINAL_STATUSES",
    "ChatMessage",
    "ErrorCode",
    "FinishReason",
    "JobRequest",
    "JobResult",
    "JobStatus",
    "JobTimings",
    "SamplingParams",
    "Usage",
]
