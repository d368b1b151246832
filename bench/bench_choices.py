"""TTFT of a job with n choices against n=1, on the engine alone (no queue): the job's sequences
added together (workers.choices: the siblings are forked from the first's prefill), the time from
adding them to the job's first token and to every choice's first token; and the same with the
prefix cache off. (Forking does not need the prefix cache; for what n costs without any sharing,
compare n=1 at n times the prompt length.)

    python bench/bench_choices.py --preset llama3-8b --lens 512,2000 --ns 1,2,4,8 --out DIR   # on a GPU
    python bench/bench_choices.py --preset tiny --device cpu --lens 100 --ns 1,4 --reps 2     # the plumbing

Each prompt is new random token ids (no hit from an earlier one); each shape is run once before it
is timed (kernel compiles, graph captures). Prints a markdown table; --out also writes JSON there.

On a CPU the times say little about n: the PyTorch reference of paged prefill attention
(kernels/torch_attention.py) pads every sequence's queries to the longest, so a sibling's few
tokens cost as much attention as the whole prompt; the Triton kernel a GPU runs takes varlen
queries. `tokens computed` is the engine's own count on any device.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.sampling import SamplingParams
from workers.choices import ChoiceGroups
from workers.engine import EngineConfig, LLMEngine


def _sync(engine: LLMEngine) -> None:
    if engine.runner.device.type == "cuda":
        import torch

        torch.cuda.synchronize()


def one_job(engine: LLMEngine, groups: ChoiceGroups, job_id: str, ids: list[int], n: int) -> tuple[float, float, int]:
    """(ms to the job's first token, ms to its last choice's first token, tokens the engine
    computed until then) of one job of n choices."""
    sp = SamplingParams(max_tokens=1, temperature=1.0, seed=1, n=n)
    _sync(engine)
    t0 = time.perf_counter()
    groups.add(job_id, [ids], [None], sp)
    first = last = None
    computed = 0
    while last is None:
        step = engine.step()
        now = time.perf_counter()
        computed += step.num_batched_tokens
        if first is None and groups.first_tokens([(e.request_id, e.time) for e in step.first_tokens]):
            first = now
        if groups.finished(step.finished):  # max_tokens 1: the job ends with its last choice's first token
            last = now
    while engine.has_unfinished():
        groups.finished(engine.step().finished)
    assert first is not None
    return (first - t0) * 1e3, (last - t0) * 1e3, computed


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--lens", default="512,2000")
    ap.add_argument("--ns", default="1,2,4,8")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    lens = [int(x) for x in args.lens.split(",")]
    ns = [int(x) for x in args.ns.split(",")]
    cfg = EngineConfig(max_model_len=max(lens) + 64, max_num_batched_tokens=max(8192, max(lens) * max(ns)),
                       **({"device": args.device} if args.device else {}))
    t0 = time.perf_counter()
    engine = LLMEngine(args.preset, cfg)
    print(f"# engine up in {time.perf_counter() - t0:.1f} s on {engine.runner.device}, "
          f"block_size {cfg.block_size}, kernels {engine.runner.ops.name}", flush=True)
    groups = ChoiceGroups(engine)
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    rows = []
    count = 0
    for caching in (True, False):
        engine.kv.enable_prefix_caching = engine.kv.pool.enable_caching = caching
        for length in lens:
            shapes = [n for n in ns if caching or n != 1]  # (n=1 is the same without it: a new prompt finds nothing)
            firsts: dict[int, list[float]] = {n: [] for n in shapes}
            lasts: dict[int, list[float]] = {n: [] for n in shapes}
            computed: dict[int, int] = {}
            for rep in range(args.reps + 1):
                for n in shapes:  # interleaved, so that a drift of the clocks shifts every n alike
                    ids = [rng.randrange(vocab) for _ in range(length)]
                    count += 1
                    f, last, computed[n] = one_job(engine, groups, f"j{count}", ids, n)
                    if rep:  # the first run of a shape warms it
                        firsts[n].append(f)
                        lasts[n].append(last)
            for n in shapes:
                row = {"prefix_cache": caching, "prompt_tokens": length, "n": n,
                       "tokens_computed": computed[n], "ttft_ms": statistics.median(firsts[n]),
                       "last_choice_ttft_ms": statistics.median(lasts[n]), "ttft_ms_runs": firsts[n]}
                rows.append(row)
                print(f"# {row['prefix_cache']} L={length} n={n}: {row['ttft_ms']:.2f} / {row['last_choice_ttft_ms']:.2f} ms",
                      flush=True)
    base = {r["prompt_tokens"]: r["ttft_ms"] for r in rows if r["n"] == 1}
    print("\n| prefix cache | prompt tokens | n | tokens computed | TTFT ms (median) | last choice's first token ms"
          " | vs n=1 |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for r in rows:
        ratio = r["last_choice_ttft_ms"] / base[r["prompt_tokens"]]
        print(f"| {'on' if r['prefix_cache'] else 'off'} | {r['prompt_tokens']} | {r['n']} | {r['tokens_computed']} | "
              f"{r['ttft_ms']:.2f} | {r['last_choice_ttft_ms']:.2f} | {ratio:.3f}x |")
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        meta = {"preset": args.preset, "device": str(engine.runner.device), "block_size": cfg.block_size,
                "reps": args.reps, "kernels": engine.runner.ops.name}
        (Path(args.out) / "choices_ttft.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    engine.close()


if __name__ == "__main__":
    main()
