"""Pydantic contracts shared by every side of firsttoken (imports nothing of ours)."""

from schemas.sampling import SamplingParams

__all__ = ["SamplingParams"]
