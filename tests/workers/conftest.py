"""Worker-loop fixtures: the tiny engine on CPU, a migrated SQLite store, a LocalQueue."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from pipeline.queue import LocalQueue
from schemas.job import JobRequest
from schemas.sampling import SamplingParams


def make_engine_tiny(**kw):
    from workers.engine import EngineConfig, LLMEngine

    return LLMEngine("tiny", EngineConfig(device="cpu", **kw))




@pytest.fixture
def queue() -> LocalQueue:
    return LocalQueue(partitions=2)


def jobs(n: int, prefix: str = "j", *, max_tokens: int = 4, **kw) -> list[JobRequest]:
    """n greedy jobs that run exactly max_tokens tokens."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [
        JobRequest(id=f"{prefix}{i}", prompt=f"prompt number {i} of {prefix}", sampling=sp, **kw)
        for i in range(n)
    ]


def wait_until(cond: Callable[[], bool], timeout_s: float = 30.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.01)


def all_committed(q: LocalQueue, group: str = "local") -> bool:
    end = q.end_offsets()
    got = q.committed(group)
    return all(got.get(p, 0) >= off for p, off in end.items())
