"""Where a mixed step's time goes: many decodes plus a batch of new prompts, as in offline throughput.

    python3 bench/profile_mixed.py [--decodes 224] [--context 900] [--new 8] [--new-len 600]

Builds `--decodes` requests in pure decode at about `--context` tokens, then adds `--new` prompts of
`--new-len` tokens so the next step mixes every decode with those prefills; times such steps
(synced) and prints the top GPU kernels of one under the profiler.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine

rng = random.Random(0)


def ids(n: int) -> list[int]:
    return [rng.randrange(1000, 120000) for _ in range(n)]


def mixed_step(eng: LLMEngine, tag: str, n_new: int, new_len: int) -> tuple[float, str, int, int]:
    """Add n_new prompts, run one step (synced); return (ms, path, tokens, seqs) and abort them."""
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i in range(n_new):
        eng.add_request(f"{tag}-{i}", prompt_token_ids=ids(new_len), sampling=sp)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = eng.step()
    torch.cuda.synchronize()
    ms = (time.perf_counter() - t0) * 1e3
    for i in range(n_new):
        eng.abort(f"{tag}-{i}")
    return ms, eng.runner.last_path, out.num_batched_tokens, out.num_scheduled


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--decodes", type=int, default=224)
    ap.add_argument("--context", type=int, default=900)
    ap.add_argument("--new", type=int, default=8)
    ap.add_argument("--new-len", type=int, default=600)
    args = ap.parse_args()
    eng = LLMEngine("llama3-8b", EngineConfig(max_model_len=4096, max_num_batched_tokens=8192, max_num_seqs=256,
                                               gpu_memory_utilization=0.9))
    sp = SamplingParams(max_tokens=2000, temperature=0.0, ignore_eos=True)
    for i in range(args.decodes):
        eng.add_request(f"d{i}", prompt_token_ids=ids(args.context), sampling=sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    for _ in range(3):
        eng.step()
    acc = {"schedule": 0.0, "execute": 0.0}

    def timed(name, fn):
        def wrapper(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                acc[name] += time.perf_counter() - t
        return wrapper

    sched, execute = eng.scheduler.schedule, eng.runner.execute
    eng.scheduler.schedule = timed("schedule", sched)
    eng.runner.execute = timed("execute", execute)
    t0 = time.perf_counter()
    for _ in range(10):
        eng.step()
    torch.cuda.synchronize()
    wall = (time.perf_counter() - t0) * 100
    print(f"pure decode b{args.decodes}: {wall:.2f} ms/step, path {eng.runner.last_path}; schedule "
          f"{acc['schedule'] * 100:.2f} ms, execute (incl. GPU wait) {acc['execute'] * 100:.2f} ms, rest "
          f"{wall - (acc['schedule'] + acc['execute']) * 100:.2f} ms per step")
    eng.scheduler.schedule, eng.runner.execute = sched, execute
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            eng.step()
        torch.cuda.synchronize()
    print(f"\n## pure decode b{args.decodes}, 5 graph steps (profiled)")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=70))
    for n_new, new_len in ((args.new, args.new_len), (1, 372), (2, 250), (args.new, args.new_len)):
        for rep in range(3):
            ms, path, tok, seqs = mixed_step(eng, f"m{n_new}-{new_len}-{rep}", n_new, new_len)
            st = torch.cuda.memory_stats()
            print(f"mixed step {n_new}x{new_len} #{rep}: {ms:.1f} ms, path {path}, {tok} tokens, {seqs} seqs, "
                  f"alloc retries {st.get('num_alloc_retries')}, cudaMalloc {st.get('num_device_alloc')}")
            eng.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ms, path, tok, seqs = mixed_step(eng, "prof", 1, 372)
    print(f"\n## mixed step (profiled): {ms:.1f} ms, path {path}, {tok} tokens, {seqs} seqs")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=70))
    print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=12, max_name_column_width=70))
    # the same prefills alone, for comparison
    for i in range(args.decodes):
        eng.abort(f"d{i}")
    eng.step()
    for rep in range(3):
        ms, path, tok, seqs = mixed_step(eng, f"p{rep}", args.new, args.new_len)
        print(f"prefill-only step {rep}: {ms:.1f} ms, path {path}, {tok} tokens, {seqs} seqs")
        while eng.has_unfinished():
            eng.step()


if __name__ == "__main__":
    main()
