"""The GPU benchmarks, kept runnable: every import in bench/ resolves (imports inside functions
too, which only a GPU run would reach), and the engine and load benchmarks run end to end on the
CPU with the tiny preset (`--device cpu`), writing their JSON and markdown under $OUT. Numbers
from these runs mean nothing; the plumbing (engines side by side, floors, rows, the SLO cost
model's record) is what they check, before any device time is spent on it."""

from __future__ import annotations

import ast
import importlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _imports(path: Path) -> list[tuple[str, list[str], int]]:
    """(module, names, line) of every `from ours import ...` in a file, at any depth."""
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if (isinstance(node, ast.ImportFrom) and node.module and node.level == 0
                and node.module.split(".")[0] in {"bench", "kernels", "workers", "pipeline", "schemas", "firsttoken"}):
            out.append((node.module, [a.name for a in node.names], node.lineno))
    return out


@pytest.mark.parametrize("path", sorted((ROOT / "bench").glob("*.py")), ids=lambda p: p.name)
def test_every_import_in_the_benchmarks_resolves(path):
    missing = []
    for module, names, line in _imports(path):
        mod = importlib.import_module(module)
        missing += [f"{path.name}:{line}: {module}.{n}" for n in names if n != "*" and not hasattr(mod, n)]
    assert not missing, missing


def _run(args: list[str], out: Path, timeout: int = 300) -> None:
    env = {**os.environ, "OUT": str(out), "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert p.returncode == 0, p.stderr[-3000:]


def test_bench_engine_runs_engines_side_by_side_on_cpu(tmp_path):
    _run(["bench/bench_engine.py", "--device", "cpu", "--preset", "tiny", "--no-hf",
          "--sections", "ttft,decode,throughput", "--engines", "bf16,fp8+kv8",
          "--ttft-lengths", "64,256", "--decode-batches", "1,4", "--num-prompts", "4", "--input-len", "48", "--output-len", "0",
          "--max-num-seqs", "8"], tmp_path)
    data = json.loads((tmp_path / "bench_engine_decode_throughput_ttft_bf16_fp8kv8_seqs8.json").read_text())
    md = (tmp_path / "bench_engine_decode_throughput_ttft_bf16_fp8kv8_seqs8.md").read_text()
    assert data["engines"] == ["bf16", "fp8+kv8"]
    assert data["throughput_shape"] == {"prompts": 4, "input_len": 48, "output_len": "100-1024"}
    eng = data["ours"]["fp8+kv8"]["engine"]
    assert eng["spec"] == "fp8+kv8" and eng["quantization"] == "fp8" and eng["kv_cache_dtype"] == "fp8"
    assert "quantization" not in data["ours"]["bf16"]["engine"]  # each engine its own fields
    metrics = [r["metric"] for r in data["rows"]]
    assert metrics[:3] == ["TTFT 64", "TTFT 256", "TTFT 2048 cached + 128"] and "decode b4 per token" in metrics
    for row in data["rows"]:
        for s in data["engines"]:
            assert row[s] > 0 and row[f"{s} floor"] > 0 and row[f"{s} x floor"] > 0, row
    # an fp8 KV cache reads half the bytes: its decode floor is lower than bf16's
    b4 = next(r for r in data["rows"] if r["metric"] == "decode b4 per token")
    assert b4["fp8+kv8 floor"] < b4["bf16 floor"]
    assert "| TTFT 64 |" in md and "fp8+kv8 x floor" in md
    # 4 prompts in room for all of them: nothing preempted, and every computed token is a prompt or output token
    for s in data["engines"]:
        st = data["ours"][s]["throughput_stats"]
        assert st["preemptions"] == 0 and st["recomputed_tokens"] == 0, st
    assert "fp8+kv8 preempted 0 times, 0 tokens recomputed" in md


def test_bench_load_runs_a_tpot_target_on_cpu(tmp_path):
    _run(["bench/bench_load.py", "--device", "cpu", "--preset", "tiny", "--rates", "8", "--duration", "2",
          "--max-prompt", "256", "--tpot-targets", "none,50"], tmp_path)
    data = json.loads((tmp_path / "bench_load_tiny.json").read_text())
    rows = data["rates"]
    assert [r["tpot_target"] for r in rows] == ["none", "50"]
    for r in rows:
        assert r["requests"] > 0 and r["ttft_p50"] > 0 and r["tpot_p50"] > 0 and r["out_tok_s"] > 0, r
    # the step-cost model is fitted beside every row (one engine for all of them), with a target or not
    for r in rows:
        cm = r["cost_model"]
        assert cm["steps"] > 0 and cm["mean_rel_error"] is not None, r
    # every step the model saw, with its shape, time and the prediction before it, for an offline fit
    steps = json.loads((tmp_path / "bench_load_tiny_steps.json").read_text())
    assert len(steps["steps"]) >= sum(r["cost_model"]["steps"] for r in rows)
    assert {s[0] for s in steps["steps"]} == {0, 1, 2} and all(s[6] > 0 for s in steps["steps"])  # 0: warm-up


def test_bench_load_probes_share_the_prefixes_and_nothing_else():
    """Each probe draws its own prompts (a probe that replayed the last one's would find them in
    the prefix cache); the 8 shared prefixes are the same in every draw."""
    from bench.bench_load import workload

    a, b = (workload(16, 4, 1000, 0, draw=d, prefix_len=32, prompt_range=(48, 96)) for d in (1, 2))
    assert workload(16, 4, 1000, 0, draw=1, prefix_len=32, prompt_range=(48, 96)) == a  # deterministic
    heads = lambda w: {tuple(ids[:32]) for _, ids, _ in w}  # noqa: E731
    shared = heads(a) & heads(b)
    assert 1 <= len(shared) <= 8  # the prefixes, seen in both
    full = lambda w: {tuple(ids) for _, ids, _ in w}  # noqa: E731
    assert not full(a) & full(b)


def test_the_load_floor_counts_prefix_hits_and_grows_with_the_load():
    """load_floor_s: a prompt that repeats an earlier one's full blocks computes only the rest
    (its last token at least); twice the requests, twice the floor; an fp8 KV cache and FP8
    projections lower it."""
    from bench.common import load_floor_s, prefill_compute_s
    from workers.engine.presets import PRESETS

    cfg = PRESETS["llama3-8b"]
    rate, bw = 700e12, 4.27e12
    a = list(range(100, 164))  # 4 blocks of 16
    alone = load_floor_s(cfg, [(0.0, a, 1)], rate, bw)
    assert alone == pytest.approx(prefill_compute_s(cfg, 64, 0, rate))
    # the same prompt again: 3 blocks cached (the last block holds the token that is computed)
    again = load_floor_s(cfg, [(0.0, a, 1), (1.0, a, 1)], rate, bw) - alone
    assert again == pytest.approx(prefill_compute_s(cfg, 16, 48, rate))
    # a shared first block, then different tokens: only the first block is cached
    b = a[:16] + list(range(500, 548))
    assert load_floor_s(cfg, [(0.0, a, 1), (1.0, b, 1)], rate, bw) - alone == pytest.approx(
        prefill_compute_s(cfg, 48, 16, rate))
    # decodes read the KV cache: 8 output tokens cost more than 1
    assert load_floor_s(cfg, [(0.0, a, 8)], rate, bw) > alone
    from bench.bench_load import workload

    w1 = workload(8, 10, 1000, 0, draw=1, prefix_len=32, prompt_range=(48, 96))
    w2 = workload(16, 10, 1000, 0, draw=1, prefix_len=32, prompt_range=(48, 96))
    f1, f2 = (load_floor_s(cfg, w, rate, bw) for w in (w1, w2))
    assert 1.5 < f2 / f1 < 2.5
    assert load_floor_s(cfg, w2, rate, bw, kv_dtype_bytes=1, linear_rate=2 * rate) < 0.6 * f2


def test_bench_load_goodput_through_the_engine_core_process_on_cpu(tmp_path):
    _run(["bench/bench_load.py", "--device", "cpu", "--preset", "tiny", "--goodput", "--duration", "2",
          "--max-prompt", "256", "--search-rates", "2,4", "--search-steps", "0", "--core", "process"], tmp_path)
    data = json.loads((tmp_path / "bench_load_tiny_core_goodput.json").read_text())
    assert data["core"] == "process" and data["max_rate_server"] >= data["max_rate_interactive"] >= 0
    for r in data["rates"]:
        assert r["requests"] > 0 and r["ttft_p50"] > 0 and r["tpot_p50"] > 0 and r["model_err"] is None, r


def test_the_one_command_gpu_run_script_on_cpu(tmp_path):
    """bench/gpu_run.sh (what a device call runs) in its CPU smoke mode: a stage runs, logs, and
    the summary records its exit status."""
    env = {**os.environ, "OUT": str(tmp_path), "SMOKE": "1", "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run(["bash", "bench/gpu_run.sh", "load_fp8", "nonsense"], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    summary = (tmp_path / "summary.txt").read_text()
    assert "load_fp8: rc=0" in summary and "nonsense: unknown" in summary, summary
    data = json.loads((tmp_path / "bench_load_tiny_fp8_goodput.json").read_text())
    assert data["quantization"] == "fp8" and data["kv_cache_dtype"] == "fp8" and data["rates"][0]["requests"] > 0
    assert data["max_rate_interactive"] >= 0 and data["max_rate_server"] >= data["max_rate_interactive"]


def test_bench_grammar_runs_on_the_tiny_tokenizer(tmp_path):
    _run(["bench/bench_grammar.py", "--engines", "llguidance", "--tokenizer", "tiny", "--walks", "1",
          "--steps", "4", "--out", str(tmp_path / "grammar")], tmp_path)
    data = json.loads((tmp_path / "grammar.json").read_text())
    (eng,) = data["engines"]
    assert eng["engine"] == "llguidance" and eng["refused"] == ["ifthen", "not", "uniqueitems"]
    assert eng["not_enforced"] == [] and eng["batch64"]["steps"] == 4
    assert "| llguidance" in (tmp_path / "grammar.md").read_text()


def test_bench_guided_times_guided_against_plain_steps_on_cpu(tmp_path):
    _run(["bench/bench_guided.py", "--device", "cpu", "--preset", "tiny", "--tokenizer", "preset",
          "--batch", "4", "--steps", "8", "--prompt-len", "32"], tmp_path)
    data = json.loads((tmp_path / "bench_guided_tiny_b4.json").read_text())
    rows = {r["guided"]: r for r in data["rows"]}
    assert set(rows) == {"none", "json_object", "json_schema", "json_schema, masks in one thread", "none (again)"}
    assert all(r["tpot_ms"] > 0 and r["decode_steps"] > 0 for r in rows.values())
    assert rows["json_schema"]["mask_host_ms"] > 0 and rows["none"]["mask_host_ms"] == 0
    assert "| json_schema |" in (tmp_path / "bench_guided_tiny_b4.md").read_text()


def test_gpu_run_bundles_more_than_the_eight_files_a_device_call_returns(tmp_path):
    """The device tool brings back 8 files from $OUT: past 8, gpu_run.sh leaves all.tgz and summary.txt.
    Eight results already there (one in a subfolder) and a stage that runs nothing on the CPU
    (cached_probe) make ten files with machine.txt and summary.txt; at eight it leaves them as they are."""
    import tarfile

    def gpu_run(out):
        env = {**os.environ, "OUT": str(out), "SMOKE": "1", "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": ""}
        p = subprocess.run(["bash", "bench/gpu_run.sh", "cached_probe"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=120)
        assert p.returncode == 0, p.stderr[-2000:]

    few = tmp_path / "few"
    (few / "sub").mkdir(parents=True)
    for i in range(6):
        (few / ("sub" if i == 5 else ".") / f"r{i}.json").write_text(json.dumps({"i": i}))
    gpu_run(few)  # 6 + machine.txt + summary.txt: 8, not bundled
    assert sorted(str(f.relative_to(few)) for f in few.rglob("*") if f.is_file()) == [
        "machine.txt", "r0.json", "r1.json", "r2.json", "r3.json", "r4.json", "sub/r5.json", "summary.txt"]
    out = tmp_path / "out"
    (out / "sub").mkdir(parents=True)
    for i in range(8):
        (out / ("sub" if i == 7 else ".") / f"r{i}.json").write_text(json.dumps({"i": i}))
    gpu_run(out)
    assert sorted(f.name for f in out.iterdir()) == ["all.tgz", "summary.txt"]
    with tarfile.open(out / "all.tgz") as tar:
        names = {n.lstrip("./") for n in tar.getnames()}
        data = json.loads(tar.extractfile("./sub/r7.json").read())
        summary = tar.extractfile("./summary.txt").read().decode()
    assert {f"r{i}.json" for i in range(7)} | {"sub/r7.json", "machine.txt", "summary.txt"} <= names
    assert data == {"i": 7} and "=== summary" in summary


def test_the_scheduling_model_runs_the_real_scheduler_to_the_end():
    """bench/sim_schedule.py on a pool too small for every request at its end: with kv_reserve 0 the scheduler
    preempts and recomputes, with 1.0 it never does, "auto" (answers that run to max_tokens: it reserves 0.85 of
    their growth) less than 0, and every request finishes (the model's steps use the engine's Scheduler itself,
    so a deadlock or a lost request would show here). Answers that stop early (--stop uniform:5): "auto" learns
    it and runs more requests at once than 0.85 does."""
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sim_schedule.py"), "--prompts", "40", "--input-len", "50",
         "--output-len", "60", "--kv-tokens", "1024", "--block-size", "16", "--max-num-seqs", "32",
         "--max-num-batched-tokens", "256", "--reserve", "0,1,auto"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {r["kv_reserve"]: r for r in json.loads(out.stdout[: out.stdout.rindex("}") + 1])["rows"]}
    assert rows["auto"]["preemptions"] < rows[0.0]["preemptions"]
    assert rows[0.0]["preemptions"] > 0 and rows[0.0]["recomputed_tokens"] > 0
    assert rows[1.0]["preemptions"] == 0 and rows[1.0]["recomputed_tokens"] == 0
    assert rows[1.0]["peak_running"] <= 1024 // (16 * -(-110 // 16)) < rows[0.0]["peak_running"]
    short = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "sim_schedule.py"), "--prompts", "200", "--input-len", "50",
         "--output-len", "60", "--stop", "uniform:5", "--kv-tokens", "1024", "--block-size", "16",
         "--max-num-seqs", "32", "--max-num-batched-tokens", "256", "--reserve", "0.85,auto"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert short.returncode == 0, short.stderr[-2000:]
    rows = {r["kv_reserve"]: r for r in json.loads(short.stdout[: short.stdout.rindex("}") + 1])["rows"]}
    assert rows["auto"]["peak_running"] > rows[0.85]["peak_running"]
    bad_args = [(["--stop", bad], "--stop takes") for bad in ("uniform:0", "uniform:61", "normal:5", "uniform")]
    bad_args += [(["--reserve", bad], "--reserve takes") for bad in ("x", "1.5", "0,-0.1", "nan")]
    bad_args.append((["--max-tokens", "59"], "--max-tokens (59) must be at least --output-len (60)"))
    for args, message in bad_args:  # refused with a message, not a traceback
        out = subprocess.run([sys.executable, str(ROOT / "bench" / "sim_schedule.py"), "--output-len", "60", *args],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode != 0 and message in out.stderr and "Traceback" not in out.stderr, (args, out.stderr)
