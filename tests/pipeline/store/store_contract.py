"""ResultStore behaviour every dialect must show. Subclassed with a `store` fixture by
tests/pipeline/store/test_store_sqlite.py (SQLite) and tests/integration/test_store_postgres.py (Postgres)."""

from __future__ import annotations

import pytest
from sqlalchemy import text

from pipeline.store import ResultStore, percentile_cont
from schemas.job import ErrorCode, FinishReason, JobRequest, JobResult, JobStatus, JobTimings, Usage


def ok(
    job_id: str,
    text_: str = "out",
    *,
    worker: str = "w1",
    model: str = "m",
    ttft: float = 10.0,
    finished: float = 1000.0,
    batch_id: str | None = None,
    submitted: float | None = 990.0,
) -> JobResult:
    return JobResult(
        id=job_id,
        batch_id=batch_id,
        status=JobStatus.SUCCEEDED,
        text=text_,
        finish_reason=FinishReason.LENGTH,
        usage=Usage(prompt_tokens=7, cached_prompt_tokens=3, completion_tokens=4),
        timings=JobTimings(
            submitted_at=submitted,
            admitted_at=995.0,
            first_token_at=995.5,
            finished_at=finished,
            queue_ms=ttft / 2,
            ttft_ms=ttft,
            engine_ttft_ms=ttft / 4,
            prefill_ms=1.0,
            tpot_ms=ttft / 10,
            e2e_ms=ttft * 3,
        ),
        worker=worker,
        model=model,
    )


class StoreContract:
    """Subclasses provide a `store` fixture: a migrated, empty database."""

    def test_insert_queued_is_idempotent(self, store: ResultStore):
        jobs = [
            JobRequest(id=f"q{i}", prompt=f"p{i}", batch_id="b", submitted_at=5.0, metadata={"i": i})
            for i in range(3)
        ]
        assert store.insert_queued(jobs) == 3
        assert store.insert_queued([*jobs, jobs[0]]) == 0
        rec = store.get_job("q1")
        assert rec is not None and rec.status is JobStatus.QUEUED
        assert rec.prompt == "p1" and rec.metadata == {"i": 1} and rec.timings.submitted_at == 5.0
        assert rec.request() == jobs[1]
        assert rec.result() is None

    def test_chat_request_round_trips(self, store: ResultStore):
        job = JobRequest(
            id="c1",
            messages=[{"role": "user", "content": "héllo ✓"}],
            sampling={"temperature": 0, "seed": 3, "stop": ["\n"]},
        )
        store.insert_queued([job])
        rec = store.get_job("c1")
        assert rec is not None and rec.request() == job

    def test_tools_and_tool_turns_round_trip(self, store: ResultStore):
        tools = [{"type": "function", "function": {"name": "get_weather", "description": "é", "parameters": {
            "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}},
                 {"type": "function", "function": {"name": "now"}}]
        call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
        job = JobRequest(
            id="t1",
            messages=[{"role": "user", "content": "weather?"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                      {"role": "tool", "tool_call_id": "call_1", "content": "sunny", "name": "get_weather"}],
            tools=tools, tool_choice={"type": "function", "function": {"name": "get_weather"}},
            parallel_tool_calls=False,
        )
        plain = JobRequest(id="t2", messages=[{"role": "user", "content": "x"}])
        store.insert_queued([job, plain])
        rec = store.get_job("t1")
        assert rec is not None and rec.request() == job and rec.request().sampling.guided == job.sampling.guided
        assert rec.tool_use == job.tool_use and rec.tool_use.mode == "named" and not rec.tool_use.parallel
        store.upsert_results([ok("t1", '{"city": "Oslo"}')])
        after = store.get_job("t1").request()  # the result kept the request's tools and turns
        assert (after.tools, after.tool_choice, after.messages) == (job.tools, job.tool_choice, job.messages)
        assert store.get_job("t2").tools is None and store.get_job("t2").tool_use is None

    def test_upsert_results_idempotent_and_never_overwrites_terminal(self, store: ResultStore):
        store.insert_queued([JobRequest(id="a", prompt="x", batch_id="b", submitted_at=990.0)])
        assert store.upsert_results([ok("a", "first")]) == 1
        # a re-delivered / late result for a terminal row writes nothing
        assert store.upsert_results([ok("a", "second")]) == 0
        assert store.upsert_results([JobResult.failure("a", ErrorCode.ENGINE_ERROR, "boom")]) == 0
        rec = store.get_job("a")
        assert rec is not None
        assert rec.status is JobStatus.SUCCEEDED and rec.text == "first"
        assert rec.prompt == "x" and rec.batch_id == "b"
        assert rec.usage == Usage(prompt_tokens=7, cached_prompt_tokens=3, completion_tokens=4)
        assert rec.timings.ttft_ms == 10.0 and rec.timings.first_token_at == 995.5
        assert rec.result() == ok("a", "first", batch_id="b")
        with store.engine.connect() as conn:
            count = conn.execute(text("SELECT count(*) FROM jobs")).scalar()
        assert count == 1

    def test_upsert_without_queued_row_inserts_with_request(self, store: ResultStore):
        req = JobRequest(id="k", prompt="from kafka", batch_id="bk", submitted_at=980.0)
        assert store.upsert_results([ok("k", submitted=None)], requests={"k": req}) == 1
        rec = store.get_job("k")
        assert rec is not None and rec.prompt == "from kafka" and rec.batch_id == "bk"
        assert rec.timings.submitted_at == 980.0
        assert store.upsert_results([ok("r")]) == 1
        assert store.get_job("r").prompt is None  # type: ignore[union-attr]

    def test_duplicates_in_one_call_write_once(self, store: ResultStore):
        assert store.upsert_results([ok("d", "one"), ok("d", "two"), ok("e")]) == 2
        assert store.get_job("d").text == "one"  # type: ignore[union-attr]

    def test_many_rows_in_chunks(self, store: ResultStore):
        store.batch_rows = 100
        results = [ok(f"m{i:04d}") for i in range(1234)]
        assert store.upsert_results(results) == 1234
        assert store.upsert_results(results) == 0
        assert len(store.list_jobs(limit=5000)) == 1234

    def test_awkward_values_round_trip_exactly(self, store: ResultStore):
        # quotes, backslashes, non-ASCII, emoji, JSON-looking text; floats that need all 17 digits
        text_ = 'a "quoted" \\ back\\slash, naïve 日本語 🚀 {"json": [1]} \n\ttabs'
        t = 1796026886.2279642
        res = ok("aw", text_)
        res = res.model_copy(update={"timings": res.timings.model_copy(update={"submitted_at": t})})
        req = JobRequest(
            id="aw",
            prompt="p\u00e9 \"x\"",
            metadata={"nested": {"k": [1, 2.5, None, "v"]}, "none": None},
            sampling={"max_tokens": 3, "stop": ["\n"]},
        )
        assert store.upsert_results([res, ok("plain")], requests={"aw": req}) == 2
        rec = store.get_job("aw")
        assert rec is not None and rec.text == text_ and rec.timings.submitted_at == t
        assert rec.prompt == req.prompt and rec.metadata == req.metadata and rec.sampling == req.sampling
        assert rec.messages is None and store.get_job("plain").sampling is None  # type: ignore[union-attr]
        # a request column that was never given reads back as None, and a later result without
        # a request keeps what the row has
        store.insert_queued([JobRequest(id="q", prompt="queued", metadata={"a": 1})])
        assert store.upsert_results([ok("q")]) == 1
        q = store.get_job("q")
        assert q is not None and q.prompt == "queued" and q.metadata == {"a": 1} and q.messages is None

    def test_admit_marks_running_counts_deliveries_holds_the_redelivered_and_skips_terminal(self, store: ResultStore):
        queued = [JobRequest(id=f"a{i}", prompt=f"p{i}", submitted_at=5.0) for i in range(3)]
        store.insert_queued(queued)
        store.upsert_results([ok("a2")])  # a redelivered message whose result is written
        fresh = JobRequest(id="a-new", prompt="straight through the queue", priority=3)
        got = store.admit([*queued, fresh, queued[0]], worker="gpu0", admitted_at=995.0, hold_from=2)
        assert got.running == {"a0": 1, "a1": 1, "a-new": 1} and got.held == {} and got.terminal == {"a2"}
        rec = store.get_job("a0")
        assert rec is not None and rec.status is JobStatus.RUNNING and rec.worker == "gpu0"
        assert rec.timings.admitted_at == 995.0 and rec.deliveries == 1
        new = store.get_job("a-new")
        assert new is not None and new.status is JobStatus.RUNNING and new.prompt == "straight through the queue"
        assert new.priority == 3
        # delivered again (the worker died before the result): counted again, up to hold_from
        assert store.admit(queued, worker="gpu1", hold_from=2).running == {"a0": 2, "a1": 2}
        third = store.admit(queued, worker="gpu2", hold_from=2)
        assert third.running == {} and third.held == {"a0": 2, "a1": 2} and third.terminal == {"a2"}
        assert store.get_job("a0").worker == "gpu1" and store.get_job("a0").deliveries == 2  # held: unchanged
        # a held job admitted when its caller runs it: counted without a bound
        assert store.admit([queued[0]], hold_from=None).running == {"a0": 3}
        done = store.get_job("a2")
        assert done is not None and done.status is JobStatus.SUCCEEDED and done.deliveries == 0
        # a result ends it: later deliveries find it terminal
        store.upsert_results([ok("a0")])
        assert store.admit([queued[0]]).terminal == {"a0"}
        assert store.get_job("a0").status is JobStatus.SUCCEEDED
        # handed back unfinished: queued again, that delivery not counted
        assert store.hand_back(["a1", "a0"]) == 1
        a1 = store.get_job("a1")
        assert a1.status is JobStatus.QUEUED and a1.deliveries == 1 and a1.worker is None

    def test_admit_then_result(self, store: ResultStore):
        store.insert_queued([JobRequest(id="r1", prompt="x", submitted_at=990.0)])
        got = store.admit([JobRequest(id="r1", prompt="x")], worker="gpu0", admitted_at=995.0)
        assert got.running == {"r1": 1}
        rec = store.get_job("r1")
        assert (
            rec is not None
            and rec.status is JobStatus.RUNNING
            and rec.worker == "gpu0"
            and rec.timings.admitted_at == 995.0
            and rec.timings.submitted_at == 990.0
        )
        # a job seen first by a worker (straight from Kafka) gets a running row
        assert store.admit([JobRequest(id="r2", prompt="y")], worker="gpu1").running == {"r2": 1}
        assert store.get_job("r2").status is JobStatus.RUNNING  # type: ignore[union-attr]
        res = ok("r1")
        res = res.model_copy(
            update={"worker": None, "timings": res.timings.model_copy(update={"admitted_at": None})}
        )
        assert store.upsert_results([res]) == 1
        rec = store.get_job("r1")
        assert rec is not None and rec.status is JobStatus.SUCCEEDED
        assert rec.worker == "gpu0" and rec.timings.admitted_at == 995.0  # kept where the result had none
        # running never goes back over a terminal row
        again = store.admit([JobRequest(id="r1", prompt="x")], worker="gpu9")
        assert again.running == {} and again.terminal == {"r1"}
        assert store.get_job("r1").worker == "gpu0"  # type: ignore[union-attr]

    def test_failed_and_cancelled(self, store: ResultStore):
        store.insert_queued([JobRequest(id=f"f{i}", prompt="x", batch_id="bf") for i in range(3)])
        store.upsert_results([JobResult.failure("f0", ErrorCode.PROMPT_TOO_LONG, "9000 > 4096")])
        rec = store.get_job("f0")
        assert (
            rec is not None and rec.status is JobStatus.FAILED and rec.error_code is ErrorCode.PROMPT_TOO_LONG
        )
        assert rec.error_message == "9000 > 4096"
        assert store.cancel(batch_id="bf") == 2
        assert store.get_job("f0").status is JobStatus.FAILED  # type: ignore[union-attr]
        assert store.get_job("f1").status is JobStatus.CANCELLED  # type: ignore[union-attr]
        assert store.upsert_results([ok("f1")]) == 0

    def test_list_jobs_filters_and_pages(self, store: ResultStore):
        store.insert_queued(
            [JobRequest(id=f"l{i}", prompt="x", batch_id="bl" if i % 2 else "other") for i in range(10)]
        )
        store.upsert_results([ok("l1", batch_id="bl"), ok("l3", batch_id="bl")])
        in_batch = store.list_jobs(batch_id="bl")
        assert [r.id for r in in_batch] == ["l1", "l3", "l5", "l7", "l9"]
        assert [r.id for r in store.list_jobs(batch_id="bl", status="succeeded")] == ["l1", "l3"]
        assert [r.id for r in store.list_jobs(batch_id="bl", status=JobStatus.QUEUED, limit=2)] == [
            "l5",
            "l7",
        ]
        assert [r.id for r in store.list_jobs(batch_id="bl", after="l5")] == ["l7", "l9"]
        assert set(store.get_jobs(["l1", "l2", "nope"])) == {"l1", "l2"}

    def test_batch_progress_and_finalize(self, store: ResultStore):
        assert store.create_batch("B", input_format="plain", source="in.jsonl", metadata={"owner": "me"})
        assert not store.create_batch("B")
        store.insert_queued([JobRequest(id=f"B-{i}", prompt="x", batch_id="B") for i in range(4)])
        store.set_batch_total("B", 4)
        store.upsert_results(
            [
                ok("B-0", batch_id="B"),
                JobResult.failure("B-1", ErrorCode.INVALID_SAMPLING, "bad", batch_id="B"),
            ]
        )
        store.admit([JobRequest(id="B-2", prompt="x", batch_id="B")])
        batch = store.get_batch("B")
        assert (
            batch is not None
            and batch.status == "open"
            and batch.input_format == "plain"
            and batch.metadata == {"owner": "me"}
        )
        p = batch.progress
        assert p.total == 4 and p.recorded == 4 and p.done == 2 and not p.complete
        assert p.counts == {
            JobStatus.SUCCEEDED: 1,
            JobStatus.FAILED: 1,
            JobStatus.RUNNING: 1,
            JobStatus.QUEUED: 1,
        }
        assert not store.finalize_batch("B")
        store.upsert_results([ok("B-2", batch_id="B"), ok("B-3", batch_id="B")])
        assert store.batch_progress("B").complete
        assert store.finalize_batch("B")
        batch = store.get_batch("B")
        assert batch is not None and batch.status == "completed" and batch.finished_at is not None
        assert store.get_batch("nope") is None

    def test_batch_rows_in_input_order_with_their_line_columns(self, store: ResultStore):
        assert store.create_batch("L", owner="alice", input_digest="d" * 64)
        jobs = [
            JobRequest(id=f"L-{n}", custom_id=f"c{n}", batch_id="L", owner="alice", line_no=n,
                       line_format="openai_chat", prompt="x")
            for n in (3, 1, 12, 2)
        ]
        assert store.record_queued(jobs[:2]) == {"L-3", "L-1"}
        assert store.record_queued(jobs) == {"L-12", "L-2"}  # the ids inserted, not the ones already there
        failed = JobResult.failure("L-bad", ErrorCode.DUPLICATE_ID, "dup", batch_id="L", custom_id="c1")
        store.upsert_results([failed], lines={"L-bad": {"owner": "alice", "line_no": 7, "line_format": "plain"}})
        with pytest.raises(ValueError, match="not a line column"):
            store.upsert_results([failed], lines={"L-bad": {"prompt": "sneaky"}})
        order = [(r.line_no, r.id, r.custom_id) for r in store.iter_batch("L", page=2)]
        assert order == [(1, "L-1", "c1"), (2, "L-2", "c2"), (3, "L-3", "c3"), (7, "L-bad", "c1"), (12, "L-12", "c12")]
        rec = store.get_job("L-bad")
        assert rec is not None and (rec.owner, rec.line_format, rec.result().custom_id) == ("alice", "plain", "c1")
        b = store.get_batch("L")
        assert b is not None and b.owner == "alice" and b.input_digest == "d" * 64
        # a result keeps the request's line columns
        store.upsert_results([ok("L-2", batch_id="L")])
        rec = store.get_job("L-2")
        assert rec is not None and (rec.custom_id, rec.owner, rec.line_no) == ("c2", "alice", 2)
        assert store.forget_queued(["L-1", "L-2"]) == 1  # only a row still queued goes
        assert store.get_job("L-1") is None and store.get_job("L-2") is not None

    def test_finalize_waits_for_the_total_and_the_last_job(self, store: ResultStore):
        store.create_batch("F")
        store.insert_queued([JobRequest(id="F-1", prompt="x", batch_id="F")])
        store.upsert_results([ok("F-1", batch_id="F")])
        assert not store.finalize_batch("F")  # its input is still being read: no total yet
        store.set_batch_total("F", 2, input_format="plain")
        assert not store.finalize_batch("F")  # one row missing
        store.upsert_results([JobResult.failure("F-2", ErrorCode.INVALID_REQUEST, "bad", batch_id="F")])
        assert store.finalize_batch("F") and store.finalize_batch("F")  # idempotent
        b = store.get_batch("F")
        assert b is not None and b.status == "completed" and b.input_format == "plain"
        assert not store.finalize_batch("nope")

    def test_end_batch_cancels_what_is_left(self, store: ResultStore):
        store.create_batch("E")
        store.insert_queued([JobRequest(id=f"E-{i}", prompt="x", batch_id="E") for i in range(3)])
        store.upsert_results([ok("E-0", batch_id="E")])
        with pytest.raises(ValueError, match="not an end status"):
            store.end_batch("E", "completed", reason="no")
        assert store.end_batch("E", "expired", reason="window passed") == 2
        b = store.get_batch("E")
        assert b is not None and b.status == "expired" and b.finished_at is not None
        assert b.progress.counts == {JobStatus.SUCCEEDED: 1, JobStatus.CANCELLED: 2}
        assert store.get_job("E-1").error_message == "window passed"  # type: ignore[union-attr]
        assert store.end_batch("E", "failed", reason="again") == 0  # not open any more: left as it is
        assert store.get_batch("E").status == "expired"  # type: ignore[union-attr]
        assert store.end_batch("E", "failed", reason="x", from_statuses=("expired",)) == 0
        assert store.get_batch("E").status == "failed"  # type: ignore[union-attr]

    def test_logprobs_round_trip(self, store: ResultStore):
        from schemas.job import TokenLogprobs, TopLogprob

        lps = [TokenLogprobs(token=" Paris", id=12, logprob=-0.02, top=[TopLogprob(token=" Paris", id=12, logprob=-0.02),
                                                                        TopLogprob(token=" Lyon", id=40, logprob=-4.5)])]
        store.insert_queued([JobRequest(id="lp-1", prompt="x", sampling={"logprobs": 1}),
                             JobRequest(id="lp-2", prompt="x")])
        store.upsert_results([ok("lp-1").model_copy(update={"logprobs": lps, "prompt_logprobs": [None, *lps]}),
                              ok("lp-2")])
        assert store.get_job("lp-1").result().logprobs == lps  # type: ignore[union-attr]
        assert store.get_job("lp-1").result().prompt_logprobs == [None, *lps]  # type: ignore[union-attr]
        assert store.get_job("lp-1").request().sampling.logprobs == 1  # type: ignore[union-attr]
        assert store.get_job("lp-2").result().logprobs is None  # type: ignore[union-attr]

    def test_prompt_lists_and_choices_round_trip(self, store: ResultStore):
        from schemas.job import Choice, TokenLogprobs

        lp = TokenLogprobs(token="a", id=97, logprob=-0.5)
        choices = [Choice(index=0, prompt_index=0, text="one", finish_reason=FinishReason.LENGTH, logprobs=[lp],
                          echo="Kafka"),
                   Choice(index=1, prompt_index=0, text="two", finish_reason=FinishReason.STOP, logprobs=[lp]),
                   Choice(index=2, prompt_index=1, text="", finish_reason=FinishReason.LENGTH, logprobs=[])]
        job = JobRequest(id="ch-1", prompts=["Kafka", [256, 75, 97]], sampling={"n": 2, "best_of": 3})
        store.insert_queued([job, JobRequest(id="ch-2", prompt="x")])
        store.upsert_results([ok("ch-1").model_copy(update={"text": "one", "choices": choices}), ok("ch-2")])
        rec = store.get_job("ch-1")
        assert rec.request().prompts == ["Kafka", [256, 75, 97]] and rec.request().prompt is None  # type: ignore[union-attr]
        assert rec.request().sampling.n == 2 and rec.request().sampling.best_of == 3  # type: ignore[union-attr]
        assert rec.result().choices == choices and rec.text == "one"  # type: ignore[union-attr]
        assert store.get_job("ch-2").result().choices is None  # type: ignore[union-attr]
        assert store.get_job("ch-2").request().prompts is None  # type: ignore[union-attr]

    def test_count_unfinished_counts_one_owners_queued_and_running_jobs(self, store: ResultStore):
        store.insert_queued([JobRequest(id=f"cu-{i}", prompt="x", owner="carol") for i in range(4)]
                            + [JobRequest(id="cu-dave", prompt="x", owner="dave")])
        store.admit([JobRequest(id="cu-0", prompt="x", owner="carol")], worker="w")
        store.upsert_results([ok("cu-1")])
        assert store.count_unfinished("carol") == 3  # cu-0 running, cu-2 and cu-3 queued
        assert store.count_unfinished("dave") == 1 and store.count_unfinished("nobody") == 0

    def test_open_batches_are_listed_oldest_first_for_an_expiry_sweep(self, store: ResultStore):
        for name in ("OB1", "OB2", "OB3"):
            store.create_batch(name)
        store.end_batch("OB2", "cancelled", reason="x")
        later = max(b.created_at for b in (store.get_batch("OB1"), store.get_batch("OB3"))) + 1  # type: ignore[union-attr]
        ids = [b.id for b in store.open_batches(created_before=later)]
        assert "OB2" not in ids and ids.index("OB1") < ids.index("OB3")
        first = store.get_batch("OB1").created_at  # type: ignore[union-attr]
        assert "OB1" not in [b.id for b in store.open_batches(created_before=first)]  # strictly before
        page = store.open_batches(created_before=later, limit=1)
        assert len(page) == 1
        rest = [b.id for b in store.open_batches(created_before=later, after=(page[0].created_at, page[0].id))]
        assert page[0].id not in rest and set(rest) | {page[0].id} == set(ids)

    def test_files_are_listed_by_owner_a_page_at_a_time_and_deleted(self, store: ResultStore):
        ids = []
        for i in range(4):
            rec = store.put_file(f"lf-{i}", owner="lf-ann" if i != 2 else "lf-bob", purpose="batch",
                                 filename=f"f{i}.jsonl", content=b"x" * (i + 1))
            ids.append(rec.id)
        assert store.get_file("lf-3").bytes == 4  # type: ignore[union-attr]
        ann = [f.id for f in store.list_files(owner="lf-ann")]
        assert ann == ["lf-3", "lf-1", "lf-0"]  # newest first, bob's left out
        assert [f.id for f in store.list_files(owner="lf-ann", limit=1, after="lf-3")] == ["lf-1"]
        assert [f.id for f in store.list_files(owner="lf-ann", newest_first=False, after="lf-0")] == ["lf-1", "lf-3"]
        assert store.list_files(owner="lf-ann", after="lf-2") == []  # another owner's cursor: nothing
        mine = {"lf-0", "lf-1", "lf-2", "lf-3"}  # (other tests' files may share the store)
        assert [f.id for f in store.list_files(purpose="batch") if f.id in mine] == ["lf-3", "lf-2", "lf-1", "lf-0"]
        assert store.list_files(owner="lf-ann", purpose="fine-tune") == []
        assert store.delete_file("lf-1") and not store.delete_file("lf-1")
        assert store.get_file("lf-1") is None and store.file_content("lf-1") is None
        assert [f.id for f in store.list_files(owner="lf-ann")] == ["lf-3", "lf-0"]

    def test_latency_stats_of_one_owner_or_batch(self, store: ResultStore):
        store.upsert_results(
            [ok("o1", ttft=10.0, batch_id="B1"), ok("o2", ttft=20.0, batch_id="B2"), ok("o3", ttft=30.0)],
            requests={
                "o1": JobRequest(id="o1", prompt="x", owner="alice"),
                "o2": JobRequest(id="o2", prompt="x", owner="alice"),
                "o3": JobRequest(id="o3", prompt="x", owner="bob"),
            },
        )
        alice = store.latency_stats(metrics=("ttft_ms",), by=(), owner="alice")
        assert alice[0].count == 2 and alice[0].mean == pytest.approx(15.0)
        b1 = store.latency_stats(metrics=("ttft_ms",), by=(), batch_id="B1")
        assert b1[0].count == 1 and b1[0].p50 == pytest.approx(10.0)

    def test_latency_stats(self, store: ResultStore):
        # w1: ttft 1..100 ms finished in [1000, 1100); w2: ttft 200 ms; one outside the range; one failed
        results = [ok(f"t{i:03d}", worker="w1", ttft=float(i), finished=1000.0 + i) for i in range(1, 101)]
        results += [
            ok("u1", worker="w2", ttft=200.0, finished=1050.0),
            ok("u2", worker="w2", ttft=9999.0, finished=5000.0),
        ]
        results.append(JobResult.failure("x1", ErrorCode.ENGINE_ERROR, "boom", finished_at=1050.0))
        store.upsert_results(results)
        stats = store.latency_stats(since=1000.0, until=1200.0, by=("worker",))
        by_key = {(s.worker, s.metric): s for s in stats}
        w1 = by_key[("w1", "ttft_ms")]
        values = [float(i) for i in range(1, 101)]
        assert w1.count == 100
        assert w1.p50 == pytest.approx(percentile_cont(values, 0.5)) == pytest.approx(50.5)
        assert w1.p90 == pytest.approx(90.1)
        assert w1.p99 == pytest.approx(99.01)
        assert w1.mean == pytest.approx(50.5)
        assert by_key[("w1", "queue_ms")].p50 == pytest.approx(25.25)
        assert by_key[("w2", "ttft_ms")].count == 1 and by_key[("w2", "ttft_ms")].p99 == pytest.approx(200.0)
        everything = store.latency_stats(since=1000.0, until=1200.0, by=(), metrics=("ttft_ms",))
        assert len(everything) == 1 and everything[0].count == 101
        by_model = store.latency_stats(by=("worker", "model"), metrics=("e2e_ms",))
        assert {(s.worker, s.model) for s in by_model} == {("w1", "m"), ("w2", "m")}
        with pytest.raises(ValueError, match="unknown latency metric"):
            store.latency_stats(metrics=("prompt; DROP TABLE jobs",))

    def test_job_latency_view(self, store: ResultStore):
        store.upsert_results([ok("v1", ttft=12.0), ok("v2", ttft=20.0)])
        store.insert_queued([JobRequest(id="v3", prompt="x")])
        with store.engine.connect() as conn:
            rows = conn.execute(
                text(
                    "SELECT id, ttft_ms, pipeline_overhead_ms, cached_prompt_tokens, submitted_time FROM job_latency ORDER BY id"
                )
            ).all()
        assert [r.id for r in rows] == ["v1", "v2"]
        assert rows[0].ttft_ms == 12.0 and rows[0].pipeline_overhead_ms == pytest.approx(9.0)
        assert rows[0].cached_prompt_tokens == 3 and rows[0].submitted_time is not None


def check_upgrade_from_0001(url: str) -> None:
    """An existing database (revision 0001) upgrades in place: its jobs keep their ids, which were
    the clients', now also in custom_id; new columns are empty; the latency view has custom_id."""
    from alembic import command
    from sqlalchemy import inspect

    from pipeline.store import make_engine, migrate
    from pipeline.store.migrate import alembic_config

    migrate(url, "0001")
    engine = make_engine(url)
    with engine.begin() as conn:
        conn.execute(
            text(
                "INSERT INTO jobs (id, batch_id, status, priority, ttft_ms, finished_at, created_at, updated_at) "
                "VALUES ('client-7', 'old-batch', 'succeeded', 0, 12.5, 1000.0, 1.0, 1.0)"
            )
        )
        conn.execute(
            text("INSERT INTO batches (id, status, created_at, updated_at) VALUES ('old-batch', 'open', 1.0, 1.0)")
        )
    migrate(url)
    store = ResultStore(engine)
    rec = store.get_job("client-7")
    assert rec is not None and rec.custom_id == "client-7" and rec.owner is None and rec.line_no is None
    assert [r.id for r in store.iter_batch("old-batch")] == ["client-7"]  # no line numbers: by id
    b = store.get_batch("old-batch")
    assert b is not None and b.owner is None and b.input_digest is None
    with engine.connect() as conn:
        row = conn.execute(text("SELECT custom_id, ttft_ms FROM job_latency")).one()
    assert tuple(row) == ("client-7", 12.5)
    command.downgrade(alembic_config(url), "0001")  # and back down
    with engine.connect() as conn:
        assert "custom_id" not in {c["name"] for c in inspect(conn).get_columns("jobs")}
        assert conn.execute(text("SELECT id FROM job_latency")).scalar() == "client-7"
    engine.dispose()
