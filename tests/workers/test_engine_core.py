"""The engine core in a child process (workers.engine_core.ProcessCore) under the worker loop, on
LocalQueue + SQLite: the same tokens as the in-thread engine, rejections as failed rows, cancel
and hand-back across the pipe, a dead core stops the worker, a dead worker takes its core along."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from pipeline.queue import LocalQueue
from schemas.job import ChatMessage, ErrorCode, JobRequest, JobStatus
from schemas.sampling import SamplingParams
from tests.workers.conftest import all_committed, jobs, make_engine_tiny, wait_until
from workers.engine import EngineConfig
from workers.engine_core import EngineCoreError, ProcessCore
from workers.sink import SinkConfig
from workers.worker import Worker, WorkerConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def core():
    c = ProcessCore("tiny", EngineConfig(device="cpu"), torch_threads=1)
    yield c
    c.stop()


def start(core_or_engine, queue, store, name="w-proc") -> Worker:
    sink = SinkConfig(backoff_initial_s=0.02, backoff_max_s=0.1)
    w = Worker(core_or_engine, queue.consumer(), store, WorkerConfig(name=name, sink=sink), model_name="tiny")
    # one core serves the module's workers: stop() would stop it, so each test stops only its worker
    w.core = _Unstoppable(w.core)
    return w.start()


class _Unstoppable:
    def __init__(self, core):
        self._core = core

    def stop(self, timeout_s: float = 10.0) -> None:
        pass

    def __getattr__(self, name):
        return getattr(self._core, name)


def mixed_jobs() -> list[JobRequest]:
    sp = SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True)
    return [
        *jobs(6, "m", max_tokens=5),
        JobRequest(id="seeded", prompt="sampled with a seed", sampling=SamplingParams(max_tokens=6, seed=7)),
        JobRequest(id="chat", messages=[ChatMessage(role="user", content="hello")], sampling=sp),
        JobRequest(id="long", prompt="x" * 5000, sampling=sp),
        JobRequest(id="ctx", prompt="short", sampling=SamplingParams(max_tokens=100_000)),
        JobRequest(id="scored", prompt="log-probabilities cross the pipe",
                   sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, logprobs=2,
                                           prompt_logprobs=1)),
        # jobs of several choices: each sequence an engine request in the core, one result out of it
        JobRequest(id="n3", prompt="three seeded samples", sampling=SamplingParams(max_tokens=6, seed=5, n=3)),
        JobRequest(id="list", prompts=["a text prompt", [72, 105, 33]],
                   sampling=SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, n=2, logprobs=1)),
        JobRequest(id="best", prompt="the likeliest two", sampling=SamplingParams(max_tokens=5, seed=3, n=2, best_of=3)),
        JobRequest(id="echo0", prompts=[[72, 105]], sampling=SamplingParams(max_tokens=0, echo=True, logprobs=0)),
        JobRequest(id="badids", prompts=[[1, 2], [3, 4096]], sampling=SamplingParams(max_tokens=2, n=2)),
    ]


def run(core_or_engine, store, batch) -> dict:
    queue = LocalQueue(partitions=2)
    w = start(core_or_engine, queue, store)
    try:
        queue.publish(batch)
        wait_until(lambda: all_committed(queue), timeout_s=60, what="every offset committed")
    finally:
        w.stop()
    return {r.id: r for r in store.list_jobs()}


def assert_logprobs_close(got, want, what: str) -> None:
    """Same tokens and alternatives; log-probabilities equal up to float32 rounding. The two runs
    batch the jobs as they happen to arrive, and a row's logits move in the last bits with the
    step's other rows (1e-7 seen); a wrong row, position or token moves them by far more."""
    assert (got is None) == (want is None), what
    if got is None:
        return
    assert len(got) == len(want), what
    for a, b in zip(got, want):
        assert (a is None) == (b is None), what
        if a is None:
            continue
        assert (a.id, a.token, [t.id for t in a.top]) == (b.id, b.token, [t.id for t in b.top]), what
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4), what
        assert [t.logprob for t in a.top] == pytest.approx([t.logprob for t in b.top], abs=1e-4), what


def test_process_core_gives_the_in_thread_results(core, store, tmp_path):
    from pipeline.store import ResultStore, migrate

    got = run(core, store, mixed_jobs())
    url = f"sqlite:///{tmp_path / 'thread.db'}"
    migrate(url)
    ref_store = ResultStore.from_url(url)
    ref = run(make_engine_tiny(), ref_store, mixed_jobs())
    ref_store.close()
    assert sorted(got) == sorted(ref) and len(got) == 16
    for jid, r in got.items():
        assert r.status is ref[jid].status and r.error_code is ref[jid].error_code, jid
        assert r.text == ref[jid].text and r.usage == ref[jid].usage, jid
        assert (r.choices is None) == (ref[jid].choices is None), jid
        for a, b in zip(r.choices or (), ref[jid].choices or (), strict=True):
            assert (a.index, a.prompt_index, a.text, a.finish_reason, a.echo) == (
                b.index, b.prompt_index, b.text, b.finish_reason, b.echo), jid
            assert_logprobs_close(a.logprobs, b.logprobs, jid)
        assert_logprobs_close(r.result().logprobs, ref[jid].result().logprobs, jid)  # type: ignore[union-attr]
    scored = got["scored"].result()
    assert scored is not None and len(scored.logprobs) == 4 and all(len(lp.top) == 2 for lp in scored.logprobs)
    assert scored.prompt_logprobs[0] is None and len(scored.prompt_logprobs) == scored.usage.prompt_tokens
    assert_logprobs_close(scored.prompt_logprobs, ref["scored"].result().prompt_logprobs, "scored")
    assert got["long"].error_code is ErrorCode.PROMPT_TOO_LONG and "tokens" in got["long"].error_message
    assert got["ctx"].error_code is ErrorCode.PROMPT_TOO_LONG and "max_tokens" in got["ctx"].error_message
    n3 = got["n3"].choices
    assert [c.index for c in n3] == [0, 1, 2] and len({c.text for c in n3}) == 3 and got["n3"].text == n3[0].text
    assert [(c.index, c.prompt_index) for c in got["list"].choices] == [(0, 0), (1, 0), (2, 1), (3, 1)]
    assert got["list"].usage.completion_tokens == 16 and all(len(c.logprobs) == 4 for c in got["list"].choices)
    assert [c.index for c in got["best"].choices] == [0, 1] and got["best"].usage.completion_tokens <= 15
    assert all(c.logprobs is None for c in got["best"].choices)  # ranked by them, not asked for
    (e0,) = got["echo0"].choices
    assert (e0.text, e0.echo, e0.logprobs, got["echo0"].usage.completion_tokens) == ("", "Hi", [], 0)
    assert got["badids"].error_code is ErrorCode.INVALID_REQUEST
    assert "prompt 1: token id 4096 is outside the vocabulary" in got["badids"].error_message
    for jid in ("m0", "seeded", "chat"):
        t = got[jid].timings
        assert got[jid].status is JobStatus.SUCCEEDED and got[jid].worker == "w-proc"
        assert t.submitted_at <= t.admitted_at <= t.first_token_at <= t.finished_at
        assert 0 < t.engine_ttft_ms == pytest.approx((t.first_token_at - t.admitted_at) * 1e3, abs=1e-2)
        assert t.prefill_ms <= t.engine_ttft_ms + 1e-6


def test_cancel_and_hand_back_cross_the_pipe(core, store):
    queue = LocalQueue(partitions=1)
    w = start(core, queue, store)
    queue.publish(jobs(1, "c", max_tokens=1500))
    wait_until(lambda: "c0" in w._inflight and w._inflight["c0"].first_token_mono is not None, what="c0 running")
    w.cancel(["c0"])
    wait_until(lambda: store.get_job("c0") is not None and store.get_job("c0").status is JobStatus.CANCELLED,
               what="c0 cancelled")
    queue.publish(jobs(3, "slow", max_tokens=1500))
    wait_until(lambda: len(w._inflight) == 3, what="slow jobs admitted")
    w.stop(drain=True, timeout_s=0.0)  # hand them back at once
    assert w.counters.handed_back == 3 and w.counters.cancelled == 1
    # the handed-back jobs are queued again, their delivery not counted against them
    assert [(r.id, r.status, r.deliveries) for r in store.list_jobs()] == [("c0", JobStatus.CANCELLED, 1)] + [
        (f"slow{i}", JobStatus.QUEUED, 0) for i in range(3)]
    c0 = store.get_job("c0")
    assert 0 < c0.usage.completion_tokens < 1500 and c0.error_code is ErrorCode.CANCELLED
    assert not all_committed(queue)
    # the core is idle again: the aborted requests left it
    wait_until(lambda: w._stats is not None, what="stats")
    w2 = start(core, queue, store, name="w-proc-2")
    try:
        wait_until(lambda: w2._stats is not None and w2._stats.running + w2._stats.waiting == 3, what="stats")
        w2.cancel(batch_id=None, job_ids=["slow0", "slow1", "slow2"])
        wait_until(lambda: all_committed(queue), what="cancelled and committed")
    finally:
        w2.stop()
    assert {r.id: r.status for r in store.list_jobs()} == {
        "c0": JobStatus.CANCELLED, "slow0": JobStatus.CANCELLED, "slow1": JobStatus.CANCELLED,
        "slow2": JobStatus.CANCELLED,
    }


def test_a_dead_core_stops_the_worker_and_commits_nothing_unfinished(store):
    core = ProcessCore("tiny", EngineConfig(device="cpu"), torch_threads=1)
    queue = LocalQueue(partitions=1)
    w = Worker(core, queue.consumer(), store, WorkerConfig(name="w-dies"), model_name="tiny").start()
    try:
        queue.publish(jobs(2, "d", max_tokens=5000 // 4))
        wait_until(lambda: len(w._inflight) == 2, what="jobs admitted")
        os.kill(core.pid, signal.SIGKILL)
        assert w.wait(10.0)
        assert isinstance(w.failed_with, EngineCoreError) and "exited" in str(w.failed_with)
    finally:
        w.stop(drain=False)
    # no result and nothing committed: the jobs are delivered again, and this delivery counts
    # against them (ResultStore.admit): one that keeps killing workers is failed after a few
    assert [(r.status, r.deliveries, r.text) for r in store.list_jobs()] == [(JobStatus.RUNNING, 1, None)] * 2
    assert queue.committed() == {}


def running(pid: int) -> bool:
    """Alive and not a zombie (an orphan's zombie waits for whoever reaps it)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError):
        return False


def test_the_core_process_exits_when_its_worker_is_killed(tmp_path):
    script = textwrap.dedent(
        f"""
        import sys, time
        sys.path.insert(0, {str(ROOT)!r})
        from workers.engine import EngineConfig
        from workers.engine_core import ProcessCore
        if __name__ == "__main__":
            core = ProcessCore("tiny", EngineConfig(device="cpu"), torch_threads=1)
            print(core.pid, flush=True)
            time.sleep(600)
        """
    )
    path = tmp_path / "parent.py"
    path.write_text(script)
    parent = subprocess.Popen([sys.executable, str(path)], stdout=subprocess.PIPE, text=True)
    try:
        child = int(parent.stdout.readline())
        assert running(child)
        parent.kill()
        parent.wait(10)
        deadline = time.monotonic() + 10
        while running(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        if running(child):
            os.kill(child, signal.SIGKILL)
            raise AssertionError("the engine core outlived its worker by 10 s")
    finally:
        if parent.poll() is None:
            parent.kill()


def test_a_core_that_cannot_load_its_model_says_why():
    with pytest.raises(EngineCoreError, match=r"failed to start.*no-such-model"):
        ProcessCore("/no-such-model", EngineConfig(device="cpu"))


def test_commands_never_wait_on_outputs_nobody_reads(core):
    """A worker thread blocked sending to a core that is blocked sending its outputs would be a
    deadlock: the core's outputs are read off the pipe as they come, read by the worker or not.
    Here ~200 KB of outputs nobody reads (rejections that echo 2 KB request ids; more than a pipe
    buffer, ~95 KB on Linux), then ~300 KB of commands."""
    import threading

    from workers.engine_core import AddRequest

    too_long = SamplingParams(max_tokens=100_000)
    core.submit([AddRequest(f"{i}-" + "r" * 2000, "p", None, too_long) for i in range(100)])
    noise = [f"{n}-" + "z" * 1000 for n in range(5)]  # aborts of unknown ids: nothing for the engine
    # once the core has emitted them (it reads commands for as long as they keep coming)
    sent = threading.Thread(
        target=lambda: time.sleep(1.0) or [core.abort(noise) for _ in range(60)], daemon=True
    )
    sent.start()
    sent.join(30)
    assert not sent.is_alive(), "a command blocked behind unread outputs"
    rejected: dict[str, str] = {}
    deadline = time.monotonic() + 30
    while len(rejected) < 100 and time.monotonic() < deadline:
        out = core.get(0.5)
        if out is not None:
            rejected.update((rid, code) for rid, code, _ in out.rejected)
    assert len(rejected) == 100 and set(rejected.values()) == {"prompt_too_long"}  # max_tokens past the context
