"""Fair intake and commits under a backlog: one batch on several `firsttoken worker` processes.

A batch of N jobs (default 2000) lands on a topic of P partitions (8) at once, and W worker
processes (2: tiny model on CPU, max_num_seqs 16, backlog 64) serve it. Reported per partition:
when its first result came (seconds after submission) and its median TTFT; their max/min ratio
is the fairness figure (target <= 1.5x). With --kill-at F, every worker is killed with SIGKILL
once that fraction of the batch is written, and new workers finish it: reported then are the
jobs run again (engine admissions beyond one per job, from jobs.deliveries), against the
workers' in-flight window (max_num_seqs + backlog each).

    scripts/services.sh start && eval "$(scripts/services.sh env)"
    .venv/bin/python bench/bench_fairness.py [--jobs 2000 --workers 2 --partitions 8 --kill-at 0.8]

Prints JSON, then a markdown table (--out FILE also writes the JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from sqlalchemy import func, select  # noqa: E402

from pipeline.producer import Producer  # noqa: E402
from pipeline.queue.base import routing_key  # noqa: E402
from pipeline.queue.kafka import KafkaQueue, delete_topics  # noqa: E402
from pipeline.queue.kafka_batches import partitions_for  # noqa: E402
from pipeline.settings import Settings  # noqa: E402
from pipeline.store import ResultStore, make_engine, migrate  # noqa: E402
from pipeline.store.tables import jobs as jobs_table  # noqa: E402
from schemas.job import JobRequest, JobStatus  # noqa: E402
from schemas.sampling import SamplingParams  # noqa: E402


def worker_env(s: Settings, name: str, max_num_seqs: int, backlog: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update({
        "FIRSTTOKEN_KAFKA_BOOTSTRAP": s.kafka_bootstrap, "FIRSTTOKEN_JOBS_TOPIC": s.jobs_topic,
        "FIRSTTOKEN_DLQ_TOPIC": s.dlq_topic, "FIRSTTOKEN_CONSUMER_GROUP": s.consumer_group,
        "FIRSTTOKEN_JOBS_PARTITIONS": str(s.jobs_partitions), "FIRSTTOKEN_DATABASE_URL": s.database_url,
        "FIRSTTOKEN_WORKER_NAME": name, "FIRSTTOKEN_DEVICE": "cpu", "FIRSTTOKEN_MODEL": "tiny",
        "FIRSTTOKEN_MAX_NUM_SEQS": str(max_num_seqs), "FIRSTTOKEN_MAX_WAITING": str(backlog),
        "FIRSTTOKEN_TORCH_THREADS": "1",
    })
    return env


def start_workers(s: Settings, names: list[str], log_dir: Path, max_num_seqs: int, backlog: int) -> list:
    procs = []
    for name in names:
        log = (log_dir / f"{name}.log").open("wb")
        procs.append(subprocess.Popen([sys.executable, "-m", "firsttoken.cli", "worker"], cwd=ROOT,
                                      env=worker_env(s, name, max_num_seqs, backlog), stdout=log,
                                      stderr=subprocess.STDOUT, start_new_session=True))
    return procs


def done(store: ResultStore, batch: str) -> int:
    return store.batch_progress(batch).done


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--jobs", type=int, default=2000)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--backlog", type=int, default=64)
    ap.add_argument("--kill-at", type=float, default=None, help="kill -9 every worker at this fraction done")
    ap.add_argument("--timeout", type=float, default=900.0)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()

    t = uuid.uuid4().hex[:8]
    s = Settings().model_copy(update={"jobs_topic": f"bench.fair.{t}", "dlq_topic": f"bench.fair.{t}.dlq",
                                      "consumer_group": f"bench-fair-{t}", "jobs_partitions": a.partitions})
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench-fair-{t}"
    log_dir.mkdir(parents=True)
    migrate(s.database_url)
    store = ResultStore(make_engine(s.database_url))
    queue = KafkaQueue(s)
    batch = f"fair-{t}"
    names = [f"fair{i}" for i in range(a.workers)]
    procs = start_workers(s, names, log_dir, a.max_num_seqs, a.backlog)
    killed_at = None
    try:
        time.sleep(8.0)  # the workers load the model and join the group before the batch lands
        sp = SamplingParams(max_tokens=a.max_tokens, temperature=0.0, ignore_eos=True)
        jobs = [JobRequest(id=f"{batch}-{i}", batch_id=batch, prompt=f"job {i}: say something about {i * 7}",
                           sampling=sp) for i in range(a.jobs)]
        store.create_batch(batch)
        t0 = time.time()
        Producer(queue, store).submit(jobs)
        store.set_batch_total(batch, a.jobs)
        deadline = time.monotonic() + a.timeout
        while done(store, batch) < a.jobs:
            if time.monotonic() > deadline:
                raise SystemExit(f"timed out: {done(store, batch)} of {a.jobs} done")
            if a.kill_at is not None and killed_at is None and done(store, batch) >= a.kill_at * a.jobs:
                killed_at = done(store, batch)
                for p in procs:
                    os.killpg(p.pid, signal.SIGKILL)
                for p in procs:
                    p.wait()
                procs = start_workers(s, [f"{n}-again" for n in names], log_dir, a.max_num_seqs, a.backlog)
            time.sleep(0.2)
        wall = time.time() - t0
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
    parts = partitions_for([routing_key(j, s.prefix_key_chars) for j in jobs], queue.partitions).tolist()
    part_of = {j.id: p for j, p in zip(jobs, parts)}
    rows = store.list_jobs(batch_id=batch, limit=a.jobs + 10)
    assert len(rows) == a.jobs and all(r.status is JobStatus.SUCCEEDED for r in rows)
    per: dict[int, dict] = {}
    for p in sorted(set(parts)):
        mine = [r for r in rows if part_of[r.id] == p]
        ttft = [r.timings.ttft_ms for r in mine if r.timings.ttft_ms is not None]
        first = min(r.timings.first_token_at for r in mine) - t0
        per[p] = {"jobs": len(mine), "first_result_s": round(first, 2), "ttft_p50_ms": round(statistics.median(ttft), 1)}
    medians = [v["ttft_p50_ms"] for v in per.values()]
    with store.engine.connect() as conn:
        admissions = conn.execute(select(func.sum(jobs_table.c.deliveries)).where(jobs_table.c.batch_id == batch)).scalar()
    out = {
        "bench": "fairness", "date": time.strftime("%Y-%m-%d"), "commit": os.environ.get("FIRSTTOKEN_COMMIT") or
        subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip(),
        "machine": f"{platform.node()} ({os.cpu_count()} cores, CPU, tiny model)",
        "jobs": a.jobs, "workers": a.workers, "partitions": queue.partitions, "max_num_seqs": a.max_num_seqs,
        "backlog": a.backlog, "wall_s": round(wall, 1), "per_partition": per,
        "ttft_p50_max_over_min": round(max(medians) / min(medians), 2),
        "killed_at_done": killed_at, "admissions": int(admissions or 0),
        "run_again": int(admissions or 0) - a.jobs,
        "in_flight_window": a.workers * (a.max_num_seqs + a.backlog),
    }
    print(json.dumps(out, indent=2))
    print("\n| partition | jobs | first result (s) | TTFT p50 (ms) |\n|---|---|---|---|")
    for p, v in per.items():
        print(f"| {p} | {v['jobs']} | {v['first_result_s']} | {v['ttft_p50_ms']} |")
    print(f"\nTTFT p50 max/min: {out['ttft_p50_max_over_min']}x; run again: {out['run_again']} "
          f"(in-flight window {out['in_flight_window']}); wall {out['wall_s']} s")
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2) + "\n")
    store.close()
    queue.close()
    delete_topics(s, [s.jobs_topic, s.dlq_topic], timeout_s=10.0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
