"""End-to-end engine benchmarks on one GPU, each beside Hugging Face transformers and the floor.

    python3 bench/bench_engine.py --sections ttft,decode      # TTFT and time per output token
    python3 bench/bench_engine.py --sections throughput        # offline throughput (1000 prompts)

Model: the Llama-3.1-8B shape with random bf16 weights (preset `llama3-8b`). Floors use a bf16
matmul rate and a copy bandwidth measured at the start of the same run.
"""

from __future__ import annotations

import argparse
import gc
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import (
    header,
    kv_bytes,
    md_table,
    measure_ceilings,
    prefill_flops,
    throughput_floor_s,
    weight_bytes,
    write_report,
)
from kernels._triton import kernel_compiles
from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine
from workers.engine.presets import get_preset

TTFT_LENGTHS = [512, 2048, 8192, 32768]
DECODE_BATCHES = [1, 8, 64, 256]
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
_rng = random.Random(0)


def rand_ids(n: int, vocab: int) -> list[int]:
    return [_rng.randrange(1000, vocab - 1000) for _ in range(n)]


# ---- Hugging Face transformers side -----------------------------------------------------------
def hf_model(preset: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    c = get_preset(preset)
    cfg = LlamaConfig(
        vocab_size=c.vocab_size, hidden_size=c.hidden_size, intermediate_size=c.intermediate_size,
        num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads, num_key_value_heads=c.num_kv_heads,
        head_dim=c.head_dim, rms_norm_eps=c.rms_norm_eps, rope_theta=c.rope_theta,
        rope_scaling=dict(c.rope_scaling, rope_theta=c.rope_theta) if c.rope_scaling else None,
        max_position_embeddings=c.max_position_embeddings, attn_implementation="sdpa",
        bos_token_id=c.bos_token_id, eos_token_id=list(c.eos_token_ids), pad_token_id=0,
    )
    with torch.device("cuda"):
        model = LlamaForCausalLM._from_config(cfg, dtype=torch.bfloat16)
    return model.eval()


@torch.no_grad()
def hf_generate_ms(model, ids: torch.Tensor, new: int, reps: int, mask: torch.Tensor | None = None) -> float:
    mask = torch.ones_like(ids) if mask is None else mask
    times = []
    for _ in range(reps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                       pad_token_id=0)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def hf_section(preset: str, sections: set[str], vocab: int) -> dict[str, Any]:
    res: dict[str, Any] = {}
    model = hf_model(preset)
    if "ttft" in sections:
        for n in TTFT_LENGTHS + [2176]:
            ids = torch.tensor([rand_ids(n, vocab)], device="cuda")
            res[f"ttft_{n}"] = hf_generate_ms(model, ids, 1, reps=3 if n < 32768 else 1)
    if "decode" in sections:
        ids = torch.tensor([rand_ids(512, vocab)], device="cuda")
        t1 = hf_generate_ms(model, ids, 1, reps=2)
        t33 = hf_generate_ms(model, ids, 33, reps=2)
        res["tpot_b1"] = (t33 - t1) / 32
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return res


# ---- our engine ---------------------------------------------------------------------------------
def run_until_first_token(engine: LLMEngine, rid: str, ids: list[int]) -> float:
    """Submit one request; return ms until its first token is on the host; then drain the engine."""
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    engine.add_request(rid, prompt_token_ids=ids, sampling=ONE)
    while True:
        out = engine.step()
        if any(e.request_id == rid for e in out.first_tokens):
            break
    t = (time.perf_counter() - t0) * 1e3
    while engine.has_unfinished():
        engine.step()
    return t


def ours_ttft(engine: LLMEngine, vocab: int) -> dict[str, float]:
    res = {}
    run_until_first_token(engine, "warm", rand_ids(600, vocab))
    for n in TTFT_LENGTHS:
        reps = 7 if n < 32768 else 3
        res[f"ttft_{n}"] = statistics.median(run_until_first_token(engine, f"t{n}-{r}", rand_ids(n, vocab))
                                             for r in range(reps))
    prefix = rand_ids(2048, vocab)
    run_until_first_token(engine, "prefix-warm", prefix)
    times = []
    for r in range(7):
        times.append(run_until_first_token(engine, f"pc-{r}", prefix + rand_ids(128, vocab)))
    res["ttft_2048c_128"] = statistics.median(times)
    return res


def ours_decode(engine: LLMEngine, vocab: int, batches: list[int], steps: int = 32) -> dict[str, float]:
    res = {}
    for b in batches:
        sp = SamplingParams(max_tokens=steps + 16, temperature=0.0, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"d{b}-{i}-{time.monotonic_ns()}", prompt_token_ids=rand_ids(512, vocab), sampling=sp)
        started = 0
        while started < b:
            started += len(engine.step().first_tokens)
        engine.step()  # one more so every request is in pure decode
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(steps):
            engine.step()
        res[f"tpot_b{b}"] = (time.perf_counter() - t0) * 1e3 / steps
        while engine.has_unfinished():
            engine.step()
    return res


def ours_throughput(engine: LLMEngine, prompts: list[list[int]], outs: list[int]) -> dict[str, float]:
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs)):
        engine.add_request(f"tp{i}", prompt_token_ids=p,
                           sampling=SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
    n_out = 0
    paths: dict[str, list[float]] = {}  # path -> [steps, seconds, tokens, sequences]
    step_log: list[tuple] = []  # (path, ms, tokens, sequences) per step
    while engine.has_unfinished():
        ts = time.perf_counter()
        out = engine.step()
        for f in out.finished:
            n_out += f.usage.completion_tokens
        p = paths.setdefault(engine.runner.last_path or "none", [0, 0.0, 0, 0])
        p[0] += 1
        p[1] += time.perf_counter() - ts
        p[2] += out.num_batched_tokens
        p[3] += out.num_scheduled
        step_log.append((engine.runner.last_path, round((time.perf_counter() - ts) * 1e3, 2),
                         out.num_batched_tokens, out.num_scheduled))
    dt = time.perf_counter() - t0
    for k, (n, sec, tok, seqs) in sorted(paths.items()):
        print(f"# step path {k}: {n} steps, {sec:.1f} s, {1e3 * sec / max(n, 1):.1f} ms/step, "
              f"{tok / max(n, 1):.0f} tokens/step, {seqs / max(n, 1):.0f} seqs/step", flush=True)
    return {"throughput_tok_s": n_out / dt, "throughput_s": dt, "throughput_tokens": n_out,
            "throughput_paths": {k: {"steps": v[0], "s": v[1], "tokens": v[2], "seqs": v[3]} for k, v in paths.items()},
            "throughput_step_log": step_log}


@torch.no_grad()
def hf_throughput(preset: str, prompts: list[list[int]], outs: list[int]) -> dict[str, float]:
    model = hf_model(preset)
    longest = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), longest, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(prompts):  # left padding
        ids[i, longest - len(p):] = torch.tensor(p)
        mask[i, longest - len(p):] = 1
    ids, mask = ids.cuda(), mask.cuda()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    model.generate(ids, attention_mask=mask, max_new_tokens=max(outs), min_new_tokens=max(outs), do_sample=False,
                   pad_token_id=0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t0
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return {"hf_throughput_tok_s": sum(outs) / dt, "hf_throughput_s": dt, "hf_throughput_prompts": len(prompts)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="ttft,decode")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--hf-prompts", type=int, default=64)
    ap.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)))
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"])
    ap.add_argument("--max-num-seqs", type=int, default=512,
                    help="sequences running at once (decode batch); more amortises the GEMMs at the cost of KV room")
    args = ap.parse_args()
    sections = set(args.sections.split(","))
    cfg = get_preset(args.preset)
    vocab = cfg.vocab_size
    data: dict[str, Any] = {"header": header(), "preset": args.preset}
    t_start = time.perf_counter()
    data["ceilings"] = ceil = measure_ceilings()
    rate = ceil["bf16_matmul_tflops"] * 1e12
    bw = ceil["copy_gbps"] * 1e9
    print(f"# ceilings {ceil}", flush=True)

    hf: dict[str, Any] = {}
    if not args.no_hf and sections & {"ttft", "decode"}:
        hf = hf_section(args.preset, sections, vocab)
        print(f"# hf {hf} ({time.perf_counter() - t_start:.0f}s)", flush=True)

    big = max(TTFT_LENGTHS) if "ttft" in sections else 8192
    ecfg = EngineConfig(max_model_len=big + 256, max_num_batched_tokens=big if "ttft" in sections else 8192,
                        max_num_seqs=args.max_num_seqs, gpu_memory_utilization=0.90, kv_cache_dtype=args.kv_cache_dtype)
    t0 = time.perf_counter()
    engine = LLMEngine(args.preset, ecfg)
    data["engine_start_s"] = time.perf_counter() - t0
    st = engine.stats()
    data["engine"] = {"kv_blocks": st.kv_blocks_total, "kernels": st.kernel_backend, "cuda_graphs": st.cuda_graphs,
                      "kv_cache_dtype": args.kv_cache_dtype, "max_num_seqs": args.max_num_seqs}
    print(f"# engine up in {data['engine_start_s']:.1f}s: {data['engine']}", flush=True)
    ours: dict[str, Any] = {}
    rows: list[dict[str, Any]] = []
    if "ttft" in sections:
        ours.update(ours_ttft(engine, vocab))
        for n in TTFT_LENGTHS:
            fl = max(prefill_flops(cfg, n) / rate, weight_bytes(cfg) / bw) * 1e3
            rows.append({"metric": f"TTFT {n}", "floor_ms": fl, "transformers_ms": hf.get(f"ttft_{n}"),
                         "firsttoken_ms": ours[f"ttft_{n}"], "x_floor": ours[f"ttft_{n}"] / fl})
        fl = max(prefill_flops(cfg, 128, 2048) / rate, (weight_bytes(cfg) + kv_bytes(cfg, 2176)) / bw) * 1e3
        rows.append({"metric": "TTFT 2048 cached + 128", "floor_ms": fl, "transformers_ms": hf.get("ttft_2176"),
                     "firsttoken_ms": ours["ttft_2048c_128"], "x_floor": ours["ttft_2048c_128"] / fl})
        print(f"# ttft done ({time.perf_counter() - t_start:.0f}s)", flush=True)
    if "decode" in sections:
        batches = [int(b) for b in args.decode_batches.split(",")]
        ours_g = ours_decode(engine, vocab, batches)
        graphs = engine.runner.graphs, engine.runner.prefill_graphs
        engine.runner.graphs = engine.runner.prefill_graphs = None
        ours_e = ours_decode(engine, vocab, batches)
        engine.runner.graphs, engine.runner.prefill_graphs = graphs
        del graphs  # they hold the runner: the transformers run below needs its memory back
        for b in batches:
            fl = (weight_bytes(cfg) + kv_bytes(cfg, b * 536)) / bw * 1e3
            rows.append({"metric": f"decode b{b} per token", "floor_ms": fl,
                         "transformers_ms": hf.get("tpot_b1") if b == 1 else None,
                         "firsttoken_ms": ours_g[f"tpot_b{b}"], "x_floor": ours_g[f"tpot_b{b}"] / fl,
                         "no_graphs_ms": ours_e[f"tpot_b{b}"]})
        ours["decode_graphs"] = ours_g
        ours["decode_eager"] = ours_e
        print(f"# decode done ({time.perf_counter() - t_start:.0f}s)", flush=True)
    if "throughput" in sections:
        r = random.Random(42)
        lens_in = [r.randint(100, 1024) for _ in range(args.num_prompts)]
        lens_out = [r.randint(100, 1024) for _ in range(args.num_prompts)]
        prompts = [[r.randrange(1000, vocab - 1000) for _ in range(n)] for n in lens_in]
        engine.scheduler.max_num_batched_tokens = 8192  # the throughput budget, whatever TTFT used
        compiles = kernel_compiles()
        ours.update(ours_throughput(engine, prompts, lens_out))
        ours["throughput_kernel_compiles"] = kernel_compiles() - compiles
        st = engine.stats()
        mem = torch.cuda.memory_stats()
        data["throughput_stats"] = {"preemptions": st.num_preemptions, "prefix_hit_rate": st.prefix_hit_rate,
                                    "alloc_retries": mem.get("num_alloc_retries"),
                                    "device_allocs": mem.get("num_device_alloc")}
        print(f"# ours throughput {ours['throughput_tok_s']:.0f} tok/s ({time.perf_counter() - t_start:.0f}s)",
              flush=True)
        if not args.no_hf:
            del engine
            gc.collect()
            torch.cuda.empty_cache()
            k = args.hf_prompts
            try:
                hf.update(hf_throughput(args.preset, prompts[:k], lens_out[:k]))
            except Exception as e:  # keep our numbers when the reference cannot run
                hf["hf_throughput_error"] = repr(e)[:500]
                print(f"# transformers throughput failed: {e!r}"[:600], flush=True)
        kvb = 1 if args.kv_cache_dtype == "fp8" else 2
        ceiling = sum(lens_out) / throughput_floor_s(cfg, lens_in, lens_out, rate, bw, kvb)
        rows.append({"metric": "offline throughput, output tok/s (floor column: the ceiling)",
                     "floor_ms": ceiling, "transformers_ms": hf.get("hf_throughput_tok_s"),
                     "firsttoken_ms": ours["throughput_tok_s"], "x_floor": ceiling / ours["throughput_tok_s"]})
    data["ours"] = ours
    data["transformers"] = hf
    data["rows"] = rows
    data["wall_s"] = time.perf_counter() - t_start
    h = data["header"]
    md = (f"### engine benchmark, {h['date']}, commit {h['commit']}, {h['machine']}, torch {h['torch']}, "
          f"triton {h['triton']}\n\nceilings: bf16 matmul {ceil['bf16_matmul_tflops']:.0f} TFLOP/s, copy "
          f"{ceil['copy_gbps']:.0f} GB/s. Columns are ms except the throughput row (output tokens/s).\n\n")
    md += md_table(rows, ["metric", "floor_ms", "transformers_ms", "firsttoken_ms", "x_floor", "no_graphs_ms"])
    kv_tag = "" if args.kv_cache_dtype == "auto" else f"_kv{args.kv_cache_dtype}"
    if args.max_num_seqs != 512:
        kv_tag += f"_seqs{args.max_num_seqs}"
    write_report("bench_engine_" + "_".join(sorted(sections)) + kv_tag, data, md)


if __name__ == "__main__":
    main()
