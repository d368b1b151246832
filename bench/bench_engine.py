"""End-to-end engine benchmarks on one GPU, each beside Hugging Face transformers and the floor.

    python3 bench/bench_engine.py --sections ttft,decode      # TTFT and time per output token
    python3 bench/bench_engine.py --sections throughput        # offline throughput (1000 prompts)
    python3 bench/bench_engine.py --sections ttft,decode,throughput --engines bf16,fp8+kv8,fp8-cublas+kv8
                                                               # FP8 engines beside bf16, each with its floor

Model: the Llama-3.1-8B shape with random bf16 weights (preset `llama3-8b`). Floors use a bf16
matmul rate and a copy bandwidth measured at the start of the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
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
    prefill_compute_s,
    throughput_floor_s,
    weight_bytes,
    write_report,
)
from kernels._triton import kernel_compiles
from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine
from workers.engine.presets import get_preset

TTFT_LENGTHS = [512, 2048, 8192, 32768]  # --ttft-lengths replaces them
DECODE_BATCHES = [1, 8, 64, 256]


def sync() -> None:
    """Wait for the GPU (nothing to wait for on a CPU smoke run)."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def free_memory() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
_rng = random.Random(0)


def token_range(vocab: int) -> tuple[int, int]:
    """Ids away from the special tokens at both ends of the vocabulary."""
    edge = min(1000, vocab // 4)
    return edge, vocab - edge


def rand_ids(n: int, vocab: int) -> list[int]:
    return [_rng.randrange(*token_range(vocab)) for _ in range(n)]


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
    sync()
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
    # each length's runs are kept beside their median: the same code moved TTFT 2048 by +-1.5 ms from
    # one device run to the next (bench/results/2026-12-03-session4-*), so the spread is part of the result
    for n in TTFT_LENGTHS:
        reps = 11 if n <= 8192 else 3
        # untimed runs at each length first: at 642cfb5 the first 2048-token run of an engine took 788 ms
        # (cuDNN's plan for a new shape) and the next three 41-44 against 27-30 after them
        for r in range(3 if n <= 8192 else 1):
            run_until_first_token(engine, f"w{n}-{r}", rand_ids(n, vocab))
        runs = [run_until_first_token(engine, f"t{n}-{r}", rand_ids(n, vocab)) for r in range(reps)]
        res[f"ttft_{n}"] = statistics.median(runs)
        res[f"ttft_{n}_runs"] = [round(t, 3) for t in runs]
    prefix = rand_ids(2048, vocab)
    run_until_first_token(engine, "prefix-warm", prefix)
    for r in range(3):  # untimed, as above (the first runs at 642cfb5: 7.2, 6.6, 6.6 against 5.9 later)
        run_until_first_token(engine, f"pcw-{r}", prefix + rand_ids(128, vocab))
    runs = [run_until_first_token(engine, f"pc-{r}", prefix + rand_ids(128, vocab)) for r in range(11)]
    res["ttft_2048c_128"] = statistics.median(runs)
    res["ttft_2048c_128_runs"] = [round(t, 3) for t in runs]
    return res


def ours_decode(engine: LLMEngine, vocab: int, batches: list[int], steps: int = 32, reps: int = 5) -> dict[str, float]:
    """ms per decode step at each batch size: the median of `reps` windows of `steps` steps (one
    window alone moved by 10% from run to run at batch 1, the first measured: clocks and caches
    settling), after a warm-up window at the first batch size."""
    res = {}
    for n, b in enumerate(batches):
        windows = reps + (n == 0)
        sp = SamplingParams(max_tokens=steps * windows + 16, temperature=0.0, ignore_eos=True)
        for i in range(b):
            engine.add_request(f"d{b}-{i}-{time.monotonic_ns()}", prompt_token_ids=rand_ids(512, vocab), sampling=sp)
        started = 0
        while started < b:
            started += len(engine.step().first_tokens)
        engine.step()  # one more so every request is in pure decode
        times = []
        for _ in range(windows):
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                engine.step()
            times.append((time.perf_counter() - t0) * 1e3 / steps)
        times = times[(n == 0):]
        res[f"tpot_b{b}"] = statistics.median(times)
        res[f"tpot_b{b}_windows"] = [round(t, 4) for t in times]
        while engine.has_unfinished():
            engine.step()
    return res


def _peak_allocations(snapshot: dict, top: int = 12) -> list[dict]:
    """From a memory snapshot's trace (the last events of torch.cuda.memory._record_memory_history's
    ring): the moment the memory allocated inside the window peaked, and the largest allocations
    live then, each with the innermost frames of this project's code that made it."""
    events = [e for trace in snapshot.get("device_traces", []) for e in trace]

    def replay(upto: int) -> tuple[dict[int, dict], int, int]:  # (live at event upto, best total, its index)
        live: dict[int, dict] = {}
        cur = best = best_i = 0
        for i, e in enumerate(events[:upto]):
            if e.get("action") == "alloc":
                live[e["addr"]] = e
                cur += e["size"]
                if cur > best:
                    best, best_i = cur, i + 1
            elif e.get("action") == "free_requested" and e["addr"] in live:
                cur -= live.pop(e["addr"])["size"]
        return live, best, best_i

    _, best, best_i = replay(len(events))
    at_best = list(replay(best_i)[0].values())
    out = []
    for e in sorted(at_best, key=lambda e: -e["size"])[:top]:
        frames = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in e.get("frames", [])
                  if any(part in f["filename"] for part in ("/workers/", "/kernels/", "/bench/"))][:4]
        out.append({"MiB": round(e["size"] / 2**20, 1), "frames": frames})
    return [{"peak_in_window_GiB": round(best / 2**30, 3), "events": len(events)}, *out]


def ours_throughput(engine: LLMEngine, prompts: list[list[int]], outs: list[int],
                    memory_trace: bool = False) -> dict[str, float]:
    """Offline throughput over the prompts; with memory_trace, each step's peak memory beyond what
    was allocated before it, and for each new record (by 256 MiB) the largest allocations live
    at that step's peak (torch's allocator history; slows eager steps)."""
    cuda = torch.cuda.is_available()
    mem_log: list[dict] = []
    record = 0
    if memory_trace and cuda:
        torch.cuda.memory._record_memory_history(max_entries=60000)
    t0 = time.perf_counter()
    for i, (p, o) in enumerate(zip(prompts, outs)):
        engine.add_request(f"tp{i}", prompt_token_ids=p,
                           sampling=SamplingParams(max_tokens=o, temperature=0.0, ignore_eos=True))
    n_out = 0
    paths: dict[str, list[float]] = {}  # path -> [steps, seconds, tokens, sequences]
    step_log: list[tuple] = []  # (path, wall ms, tokens, sequences, device ms read back) per step
    while engine.has_unfinished():
        if memory_trace and cuda:
            before = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        ts = time.perf_counter()
        dev0 = engine.device_seconds
        out = engine.step()
        dev_ms = round((engine.device_seconds - dev0) * 1e3, 2)  # the step read back in this call (async: the previous)
        if memory_trace and cuda:
            extra = torch.cuda.max_memory_allocated() - before
            if extra > record + (256 << 20):
                record = extra
                mem_log.append({"step": len(step_log), "path": engine.runner.last_path, "tokens": out.num_batched_tokens,
                                "seqs": out.num_scheduled, "step_peak_extra_GiB": round(extra / 2**30, 3),
                                "allocated_before_GiB": round(before / 2**30, 3),
                                "largest": _peak_allocations(torch.cuda.memory._snapshot())})
                print(f"# memory: {mem_log[-1]}", flush=True)
        for f in out.finished:
            n_out += f.usage.completion_tokens
        p = paths.setdefault(engine.runner.last_path or "none", [0, 0.0, 0, 0, 0.0])
        p[0] += 1
        p[1] += time.perf_counter() - ts
        p[2] += out.num_batched_tokens
        p[3] += out.num_scheduled
        p[4] += dev_ms / 1e3
        step_log.append((engine.runner.last_path, round((time.perf_counter() - ts) * 1e3, 2),
                         out.num_batched_tokens, out.num_scheduled, dev_ms))
    dt = time.perf_counter() - t0
    for k, (n, sec, tok, seqs, dev) in sorted(paths.items()):
        print(f"# step path {k}: {n} steps, {sec:.1f} s, {1e3 * sec / max(n, 1):.1f} ms/step "
              f"(device {1e3 * dev / max(n, 1):.1f}), {tok / max(n, 1):.0f} tokens/step, "
              f"{seqs / max(n, 1):.0f} seqs/step", flush=True)
    dev_total = sum(v[4] for v in paths.values())
    print(f"# device busy {dev_total:.1f} s of {dt:.1f} s wall (CUDA events per step)", flush=True)
    if memory_trace and cuda:
        torch.cuda.memory._record_memory_history(enabled=None)
    return {"throughput_tok_s": n_out / dt, "throughput_s": dt, "throughput_tokens": n_out, "memory_log": mem_log,
            "throughput_device_s": dev_total,
            "throughput_paths": {k: {"steps": v[0], "s": v[1], "tokens": v[2], "seqs": v[3], "device_s": v[4]}
                                 for k, v in paths.items()},
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


ENGINES = {  # --engines names -> EngineConfig fields
    "bf16": {},
    "fp8": {"quantization": "fp8"},  # per-channel weight scales: torch._scaled_mm, the small-M kernel in decode
    # the same with torch._scaled_mm at every batch size (the layout before the small-M kernel)
    "fp8-cublas": {"quantization": "fp8", "_env": {"FIRSTTOKEN_FP8_SMALL_M": "0"}},
    # decode at one row through the W8A8 path (the fused norm quantizing, the few-row GEMM), not the W8A16 GEMV
    "fp8-w8a8": {"quantization": "fp8", "_env": {"FIRSTTOKEN_FP8_GEMV_ROWS": "0"}},
    # an experiment: the weight-streaming kernel up to 256 rows of every projection
    "fp8-rows256": {"quantization": "fp8", "_env": {"FIRSTTOKEN_FP8_SMALL_M": "256"}},
    # the lm_head in FP8 too (EngineConfig.fp8_lm_head; its floor still counts a bf16 head)
    "fp8-head": {"quantization": "fp8", "fp8_lm_head": True},
    # A/B: decode's rope_and_cache in its own launch again and torch's argmax in the sampler
    "fp8-unfused": {"quantization": "fp8", "_env": {"FIRSTTOKEN_FUSED_DECODE_ROPE": "0", "FIRSTTOKEN_TRITON_ARGMAX": "0"}},
    # rope_and_cache inside the decode attention at every decode batch (the default: up to 16; session 25)
    "fp8-fusedall": {"quantization": "fp8", "_env": {"FIRSTTOKEN_FUSED_ROPE_MAX_BATCH": "4096"}},
    # A/B: a dense FP8 prompt's rope_and_cache, then the e4m3 cast of q | k | v, as two launches (the default since
    # session 26: one, kernels.rope_cache.rope_cache_cast_triton)
    "fp8-noropecast": {"quantization": "fp8", "_env": {"FIRSTTOKEN_FP8_ATTENTION_ROPE": "0"}},
    # _scaled_mm's accumulation: fast at every K (down_proj's too), or fp32 everywhere (the default:
    # fast up to kernels.fp8_linear.FAST_ACCUM_MAX_K; bench/bench_fp8_accum.py)
    "fp8-fastacc": {"quantization": "fp8", "_env": {"FIRSTTOKEN_FP8_FAST_ACCUM": "1"}},
    "fp8-exactacc": {"quantization": "fp8", "_env": {"FIRSTTOKEN_FP8_FAST_ACCUM": "0"}},
    # A/B: the prefill attention widening an fp8 cache to bf16 (q's dtype), not fp16 (the default)
    "fp8-widenq": {"quantization": "fp8", "_env": {"FIRSTTOKEN_PREFILL_WIDEN": "q"}},
    # A/B: prefill graphs up to 2048 tokens (the default 1024): a 2048-token prompt replays a graph
    # (the paged prefill kernel) rather than running eagerly (cuDNN's dense attention, host launches)
    "fp8-pg2048": {"quantization": "fp8", "prefill_graph_max_tokens": 2048},
    # A/B: no dense prefill graphs (a lone uncached prompt of 1025-2048 tokens runs eagerly, as before)
    "fp8-nodg": {"quantization": "fp8", "dense_graph_max_tokens": 0},
    "bf16-nodg": {"dense_graph_max_tokens": 0},
    # A/B of a 16-bit cache's V layout (kernels/kv_layout.py): keys innermost against rows (its default)
    "bf16-vt": {"kv_cache_v_layout": "keys_inner"},
    # A/B: a long uncached prompt's dense attention in bf16 (cuDNN through SDPA), not on FP8 tensor cores
    # (EngineConfig.fp8_attention, on by default with +kv8 where cuDNN's FP8 forward runs)
    "fp8-bf16attn": {"quantization": "fp8", "fp8_attention": False},
    # A/B of the paged prefill attention over an fp8 cache (a cached prefix's new tokens): QK^T on FP8
    # tensor cores (q rounded to e4m3 per row)
    "fp8-k8": {"quantization": "fp8", "_env": {"FIRSTTOKEN_PREFILL_WIDEN": "k8"}},
    # A/B: the paged prefill attention's grid per sequence (programs for a captured graph's padded sequences
    # too), not the default compact one
    "fp8-nocompact": {"quantization": "fp8", "_env": {"FIRSTTOKEN_PREFILL_COMPACT": "0"}},
    # A/B: the prefill attention's block ids a tile ahead (two K/V buffers at 3 stages: the next tile's copy under
    # this tile's math; on an H100 no faster in the engine, session 28)
    # (an fp8 cache's: a 16-bit cache's tiles have two buffers without it)
    "fp8-prefillpf": {"quantization": "fp8", "_env": {"FIRSTTOKEN_PREFILL_PREFETCH": "1"}},
    "bf16-nocompact": {"_env": {"FIRSTTOKEN_PREFILL_COMPACT": "0"}},
    # A/B: the bf16 lm_head's GEMM in bf16 then a cast to fp32 (the layout before its GEMM wrote fp32 logits)
    "fp8-bf16logits": {"quantization": "fp8", "_env": {"FIRSTTOKEN_LOGITS_FP32_GEMM": "0"}},
    "bf16-bf16logits": {"_env": {"FIRSTTOKEN_LOGITS_FP32_GEMM": "0"}},
    # A/B of the fp8 cache's block size (64, its default since session 23): blocks of 32, V keys inner, block ids prefetched
    "fp8-bs32": {"quantization": "fp8", "block_size": 32},
    # A/B: the fp8 cache's default without the block ids a tile ahead (keys-inner V read in whole blocks)
    "fp8-nopf": {"quantization": "fp8", "_env": {"FIRSTTOKEN_DECODE_TILES": '{"prefetch": false}'}},
    # A/B: the fp8 cache's layout before blocks of 64 with keys-inner V became its default (session 23): blocks of
    # 16, V in rows (the block ids not prefetched)
    "fp8-rows16": {"quantization": "fp8", "kv_cache_v_layout": "rows", "block_size": 16},
    # A/B: K (keys-inner V's default beside it) heads first, one head's block of 64 keys one 8 KB run
    "fp8-hnd": {"quantization": "fp8", "kv_cache_k_layout": "hnd"},
    # A/B: admission keeps blocks for every running request's remaining max_tokens (no preemption, no recompute)
    "fp8-reserve": {"quantization": "fp8", "kv_reserve": 1.0},
    # ... 85% of it: bench/sim_schedule.py's best on an H100's pool for TensorRT-LLM's shape (1.0 leaves a tail of 54
    # requests decoding alone; session23.md)
    "fp8-reserve85": {"quantization": "fp8", "kv_reserve": 0.85},
    # A/B: no reserve (admit while the prompt fits, preempt and recompute), the default before "auto" (session 24)
    "fp8-noreserve": {"quantization": "fp8", "kv_reserve": 0.0},
    "fp8-notma": {"quantization": "fp8", "_env": {"FIRSTTOKEN_FP8_TMA_CONFIG": "off"}},  # 65-256 rows off the TMA GEMM
}


def engine_spec(spec: str, kv_default: str) -> dict[str, Any]:
    """'fp8' or 'fp8+kv8' (the KV cache in fp8 too) -> EngineConfig fields."""
    name, _, kv = spec.partition("+")
    if name not in ENGINES or kv not in ("", "kv8"):
        raise SystemExit(f"unknown engine {spec!r}: one of {sorted(ENGINES)}, optionally +kv8")
    return {**ENGINES[name], "kv_cache_dtype": "fp8" if kv == "kv8" else kv_default}


def run_engine(spec: str, fields: dict[str, Any], args: argparse.Namespace, sections: set[str], vocab: int,
               prompts: list[list[int]], lens_out: list[int]) -> dict[str, Any]:
    """One engine through the sections; returns its numbers (the engine is freed before returning)."""
    big = max(TTFT_LENGTHS) if "ttft" in sections else 8192
    env = fields.get("_env", {})
    fields = {k: v for k, v in fields.items() if k != "_env"}
    budget = big if "ttft" in sections else args.max_num_batched_tokens
    ecfg = EngineConfig(max_model_len=args.max_model_len or max(big, 2176) + 256, max_num_batched_tokens=budget,
                        max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                        device=args.device, **fields)
    t0 = time.perf_counter()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # read when the layers are built
    try:
        engine = LLMEngine(args.preset, ecfg)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    st = engine.stats()
    ours: dict[str, Any] = {"engine_start_s": time.perf_counter() - t0, "engine": {
        "spec": spec, **fields, "kv_blocks": st.kv_blocks_total, "kernels": st.kernel_backend,
        "cuda_graphs": st.cuda_graphs, "max_num_seqs": args.max_num_seqs}}
    print(f"# engine {spec} up in {ours['engine_start_s']:.1f}s: {ours['engine']}", flush=True)
    if "ttft" in sections:
        ours.update(ours_ttft(engine, vocab))
        print(f"# {spec} ttft done", flush=True)
    if "decode" in sections:
        batches = [int(b) for b in args.decode_batches.split(",")]
        ours["decode_graphs"] = ours_decode(engine, vocab, batches)
        graphs = engine.runner.graphs, engine.runner.prefill_graphs
        engine.runner.graphs = engine.runner.prefill_graphs = None
        ours["decode_eager"] = ours_decode(engine, vocab, batches, reps=1)
        engine.runner.graphs, engine.runner.prefill_graphs = graphs
        del graphs
        print(f"# {spec} decode done", flush=True)
    if "throughput" in sections:
        engine.scheduler.max_num_batched_tokens = 8192  # the throughput budget, whatever TTFT used
        compiles = kernel_compiles()
        ours.update(ours_throughput(engine, prompts, lens_out, args.memory_trace))
        ours["throughput_kernel_compiles"] = kernel_compiles() - compiles
        st = engine.stats()
        mem = torch.cuda.memory_stats() if torch.cuda.is_available() else {}
        ours["throughput_stats"] = {"preemptions": st.num_preemptions, "prefix_hit_rate": st.prefix_hit_rate,
                                    "alloc_retries": mem.get("num_alloc_retries"),
                                    "device_allocs": mem.get("num_device_alloc"),
                                    # peaks over the engine's life, the KV cache included: the headroom
                                    # gpu_memory_utilization left unused is total x util - peak reserved
                                    "peak_allocated_gib": mem.get("allocated_bytes.all.peak", 0) / 2**30,
                                    "peak_reserved_gib": mem.get("reserved_bytes.all.peak", 0) / 2**30,
                                    "device_total_gib": torch.cuda.mem_get_info()[1] / 2**30
                                    if torch.cuda.is_available() else None,
                                    "kv_cache_gib": st.kv_blocks_total * engine.runner.kv_bytes_per_block() / 2**30}
        # tokens computed past each request's prompt + output (the last sampled token is never computed): what
        # preemption recomputed
        ours["throughput_stats"]["recomputed_tokens"] = (
            sum(p["tokens"] for p in ours["throughput_paths"].values()) - sum(map(len, prompts)) - sum(lens_out)
            + len(prompts))
        print(f"# {spec} throughput {ours['throughput_tok_s']:.0f} tok/s", flush=True)
    engine.close()  # the next engine gets the memory (del alone kept it: graphs and the runner hold it)
    free_memory()
    return ours


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sections", default="ttft,decode")
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--engines", default="bf16",
                    help=f"comma list run one after the other in this call: {', '.join(ENGINES)}; '+kv8' adds an fp8 "
                         "KV cache (e.g. bf16,fp8+kv8,fp8-cublas+kv8)")
    ap.add_argument("--no-hf", action="store_true")
    ap.add_argument("--num-prompts", type=int, default=1000)
    ap.add_argument("--input-len", type=int, default=1000,
                    help="prompt tokens of each throughput prompt (TensorRT-LLM's published shape: 1000); "
                         "0: lengths drawn from 100-1024")
    ap.add_argument("--output-len", type=int, default=1000,
                    help="tokens generated per throughput prompt (TensorRT-LLM's: 1000); 0: drawn from 100-1024")
    ap.add_argument("--hf-prompts", type=int, default=64)
    ap.add_argument("--decode-batches", default=",".join(map(str, DECODE_BATCHES)))
    ap.add_argument("--ttft-lengths", default=",".join(map(str, TTFT_LENGTHS)))
    ap.add_argument("--device", default=None, help="cuda (default when there is one); cpu for a smoke run")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8"], help="for engines without +kv8")
    ap.add_argument("--max-num-seqs", type=int, default=512,
                    help="sequences running at once (decode batch); more amortises the GEMMs at the cost of KV room")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192,
                    help="tokens per step without the ttft section (with it: the longest TTFT length)")
    ap.add_argument("--max-model-len", type=int, default=None,
                    help="the engines' max_model_len (default: the longest TTFT length + 256, at least 2432)")
    ap.add_argument("--memory-trace", action="store_true",
                    help="throughput: log the steps whose peak memory sets a record, with the largest allocations then")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.90,
                    help="share of the device's memory the engine takes (the rest of it: KV blocks)")
    args = ap.parse_args()
    TTFT_LENGTHS[:] = [int(n) for n in args.ttft_lengths.split(",")]
    sections = set(args.sections.split(","))
    specs = args.engines.split(",")
    fields = {s: engine_spec(s, args.kv_cache_dtype) for s in specs}
    cfg = get_preset(args.preset)
    vocab = cfg.vocab_size
    data: dict[str, Any] = {"header": header(), "preset": args.preset, "engines": specs}
    t_start = time.perf_counter()
    data["ceilings"] = ceil = measure_ceilings(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    rate = ceil["bf16_matmul_tflops"] * 1e12
    fp8_rate = ceil.get("fp8_matmul_tflops", 0.0) * 1e12 or None
    bw = ceil["copy_gbps"] * 1e9
    print(f"# ceilings {ceil}", flush=True)

    hf: dict[str, Any] = {}
    if not args.no_hf and sections & {"ttft", "decode"}:
        hf = hf_section(args.preset, sections, vocab)
        print(f"# hf {hf} ({time.perf_counter() - t_start:.0f}s)", flush=True)

    r = random.Random(42)
    lens_in = [args.input_len or r.randint(100, 1024) for _ in range(args.num_prompts)]
    lens_out = [args.output_len or r.randint(100, 1024) for _ in range(args.num_prompts)]
    data["throughput_shape"] = {"prompts": args.num_prompts, "input_len": args.input_len or "100-1024",
                                "output_len": args.output_len or "100-1024"}
    prompts = [[r.randrange(*token_range(vocab)) for _ in range(n)] for n in lens_in]
    ours = {s: run_engine(s, fields[s], args, sections, vocab, prompts, lens_out) for s in specs}
    print(f"# engines done ({time.perf_counter() - t_start:.0f}s)", flush=True)
    if "throughput" in sections and not args.no_hf:
        k = args.hf_prompts
        try:
            hf.update(hf_throughput(args.preset, prompts[:k], lens_out[:k]))
        except Exception as e:  # keep our numbers when the reference cannot run
            hf["hf_throughput_error"] = repr(e)[:500]
            print(f"# transformers throughput failed: {e!r}"[:600], flush=True)

    from kernels.cudnn_attention import available as fp8_attention_unavailable

    fp8_attention_here = args.device != "cpu" and fp8_attention_unavailable(args.device or "cuda") is None

    def floors(spec: str) -> dict[str, Any]:
        """This engine's floors: FP8 projections at the FP8 rate and 1 byte a weight, an fp8 KV cache at 1 byte,
        FP8 attention (dense prompts, where it runs) at the FP8 rate."""
        f = fields[spec]
        q = f.get("quantization") == "fp8" and fp8_rate is not None
        lin_rate, lin_bytes = (fp8_rate, 1) if q else (None, None)
        kvb = 1 if f["kv_cache_dtype"] == "fp8" else 2
        w = weight_bytes(cfg, 2, lin_bytes)
        # an uncached prompt on the dense path with FP8 attention: its attention at the FP8 rate too
        fa = q and kvb == 1 and f.get("fp8_attention") is not False and fp8_attention_here

        def attn_rate(n: int) -> float | None:
            return fp8_rate if fa and n >= (f.get("dense_prefill_min_tokens") or 1025) else None

        out = {f"ttft_{n}": max(prefill_compute_s(cfg, n, 0, rate, lin_rate, attn_rate(n)), w / bw) * 1e3
               for n in TTFT_LENGTHS}
        out["ttft_2048c_128"] = max(prefill_compute_s(cfg, 128, 2048, rate, lin_rate),
                                    (w + kv_bytes(cfg, 2176, kvb)) / bw) * 1e3
        for b in [int(x) for x in args.decode_batches.split(",")]:
            out[f"tpot_b{b}"] = (w + kv_bytes(cfg, b * 536, kvb)) / bw * 1e3
        out["throughput"] = sum(lens_out) / throughput_floor_s(cfg, lens_in, lens_out, rate, bw, kvb, lin_rate)
        return out

    fl = {s: floors(s) for s in specs}
    metrics: list[tuple[str, str, str | None]] = []  # (row name, key, transformers key)
    if "ttft" in sections:
        metrics += [(f"TTFT {n}", f"ttft_{n}", f"ttft_{n}") for n in TTFT_LENGTHS]
        metrics.append(("TTFT 2048 cached + 128", "ttft_2048c_128", "ttft_2176"))
    if "decode" in sections:
        metrics += [(f"decode b{b} per token", f"tpot_b{b}", "tpot_b1" if b == 1 else None)
                    for b in [int(x) for x in args.decode_batches.split(",")]]
    if "throughput" in sections:
        metrics.append(("offline throughput, output tok/s (floor columns: the ceiling)", "throughput",
                        "hf_throughput_tok_s"))
    rows: list[dict[str, Any]] = []
    for name, key, hf_key in metrics:
        row: dict[str, Any] = {"metric": name, "transformers": hf.get(hf_key) if hf_key else None}
        for s in specs:
            if key == "throughput":
                got = ours[s]["throughput_tok_s"]
            elif key.startswith("tpot_"):
                got = ours[s]["decode_graphs"][key]
                row[f"{s} no graphs"] = ours[s]["decode_eager"][key]
            else:
                got = ours[s][key]
            row[f"{s} floor"] = fl[s][key]
            row[s] = got
            row[f"{s} x floor"] = fl[s][key] / got if key == "throughput" else got / fl[s][key]
        rows.append(row)
    data["ours"] = ours
    data["floors"] = fl
    data["transformers"] = hf
    data["rows"] = rows
    data["wall_s"] = time.perf_counter() - t_start
    h = data["header"]
    fp8_txt = f", FP8 matmul {ceil['fp8_matmul_tflops']:.0f} TFLOP/s" if "fp8_matmul_tflops" in ceil else ""
    md = (f"### engine benchmark, {h['date']}, commit {h['commit']}, {h['machine']}, torch {h['torch']}, "
          f"triton {h['triton']}\n\nceilings: bf16 matmul {ceil['bf16_matmul_tflops']:.0f} TFLOP/s{fp8_txt}, copy "
          f"{ceil['copy_gbps']:.0f} GB/s. Columns are ms except the throughput row (output tokens/s); each engine's "
          f"floor counts its own projections (FP8: the FP8 rate, 1 byte a weight) and KV bytes.\n\n")
    cols = ["metric", "transformers"]
    for s in specs:
        cols += [f"{s} floor", s, f"{s} x floor"] + ([f"{s} no graphs"] if "decode" in sections else [])
    md += md_table(rows, cols)
    if "throughput" in sections:
        md += "\n\nIn the throughput run: " + "; ".join(
            f"{s} preempted {ours[s]['throughput_stats']['preemptions']} times, "
            f"{ours[s]['throughput_stats']['recomputed_tokens']:,} tokens recomputed" for s in specs) + ".\n"
    tag = "" if specs == ["bf16"] else "_" + "_".join(s.replace("+", "") for s in specs)
    if args.kv_cache_dtype != "auto":
        tag += f"_kv{args.kv_cache_dtype}"
    if args.max_num_seqs != 512:
        tag += f"_seqs{args.max_num_seqs}"
    if args.max_num_batched_tokens != 8192 and "ttft" not in sections:
        tag += f"_bt{args.max_num_batched_tokens}"
    if args.gpu_memory_utilization != 0.90:
        tag += f"_mem{args.gpu_memory_utilization:g}"
    write_report("bench_engine_" + "_".join(sorted(sections)) + tag, data, md)


if __name__ == "__main__":
    main()
