"""Where a step's time goes: CPU dispatch vs GPU time, and the top GPU kernels, per TTFT/decode case.

    python3 bench/profile_engine.py            # llama3-8b shape, random bf16 weights
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
rng = random.Random(0)


def ids(n: int) -> list[int]:
    return [rng.randrange(1000, 120000) for _ in range(n)]


def first_token(engine: LLMEngine, rid: str, prompt: list[int]) -> None:
    engine.add_request(rid, prompt_token_ids=prompt, sampling=ONE)
    while engine.has_unfinished():
        engine.step()


def dispatch_ms(engine: LLMEngine, prompt: list[int]) -> tuple[float, float]:
    """(CPU ms to issue the forward, wall ms to the synced result) for one prefill step."""
    r = engine.runner
    engine.add_request("disp", prompt_token_ids=prompt, sampling=ONE)
    out = engine.scheduler.schedule()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    input_ids, positions, meta, _rows = r.prepare(out)
    t_prep = time.perf_counter()
    with torch.inference_mode():
        _hidden, _residual = r.model(input_ids, positions, r.cos_sin, r.kv_caches, meta)
        t_issue = time.perf_counter()
        torch.cuda.synchronize()
    t_done = time.perf_counter()
    engine.abort("disp")
    engine.step()
    return ((t_prep - t0) * 1e3, (t_issue - t_prep) * 1e3, (t_done - t0) * 1e3)


def show(prof, title: str, n: int = 12) -> None:
    print(f"\n## {title}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60))


def main() -> None:
    eng = LLMEngine("llama3-8b", EngineConfig(max_model_len=33024, max_num_batched_tokens=32768,
                                               gpu_memory_utilization=0.9))
    for n in (600, 600):
        first_token(eng, f"w{n}-{rng.random()}", ids(n))
    print("prepare/issue/total ms for a 512-token prefill:", dispatch_ms(eng, ids(512)))
    print("prepare/issue/total ms for a 128-token prefill:", dispatch_ms(eng, ids(128)))
    prefix = ids(2048)
    first_token(eng, "pw", prefix)
    cases = {"ttft 512": ids(512), "ttft 2048c+128": prefix + ids(128), "ttft 2048": ids(2048),
             "ttft 8192": ids(8192), "ttft 32768": ids(32768)}
    for name, prompt in cases.items():
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            t0 = time.perf_counter()
            first_token(eng, name, prompt)
            torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        show(prof, f"{name}: wall {wall:.1f} ms (profiled)")
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for b in (1,):
        for i in range(b):
            eng.add_request(f"d{b}-{i}", prompt_token_ids=ids(512), sampling=sp)
        for _ in range(30):
            eng.step()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                eng.step()
            torch.cuda.synchronize()
        show(prof, f"decode b{b}, 5 steps, graphs on")
        while eng.has_unfinished():
            eng.step()


if __name__ == "__main__":
    main()
