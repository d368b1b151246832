"""Shared benchmark helpers: ceilings measured in the same run, model FLOP/byte counts, reports."""

from __future__ import annotations

import datetime
import json
import os
import subprocess
from pathlib import Path
from typing import Any

import torch

from workers.engine.config import ModelConfig


def measure_ceilings(device: str = "cuda") -> dict[str, float]:
    """bf16 matmul rate (TFLOP/s, 8192^3 on random data), FP8 e4m3 matmul rate (torch._scaled_mm,
    the same shape; sm89+ only) and copy bandwidth (GB/s, read+write of 4 GiB). On a CPU (a smoke
    run of a benchmark): a small fp32 matmul and copy, timed with the wall clock."""
    if torch.device(device).type != "cuda":
        return _cpu_ceilings()
    import triton.testing

    def matmul_ms(n: int) -> float:
        a = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        b = torch.randn(n, n, dtype=torch.bfloat16, device=device)
        return triton.testing.do_bench(lambda: a @ b, warmup=100, rep=500, return_mode="median")

    def fp8_matmul_ms(n: int) -> float:
        a = torch.randn(n, n, device=device).to(torch.float8_e4m3fn)
        b = torch.randn(n, n, device=device).to(torch.float8_e4m3fn).t()  # column-major, as _scaled_mm wants
        one = torch.ones((), device=device)
        return triton.testing.do_bench(lambda: torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16),
                                       warmup=100, rep=500, return_mode="median")

    def copy_ms(numel: int) -> float:
        x = torch.randn(numel, dtype=torch.float32, device=device)
        y = torch.empty_like(x)
        return triton.testing.do_bench(lambda: y.copy_(x), warmup=20, rep=200, return_mode="median")

    n = 8192
    tflops = 2 * n**3 / (matmul_ms(n) * 1e-3) / 1e12
    out = {"bf16_matmul_tflops": tflops}
    if torch.cuda.get_device_capability(device) >= (8, 9):
        out["fp8_matmul_tflops"] = 2 * n**3 / (fp8_matmul_ms(n) * 1e-3) / 1e12
    numel = 1 << 30  # 4 GiB of fp32
    out["copy_gbps"] = 2 * numel * 4 / (copy_ms(numel) * 1e-3) / 1e9
    torch.cuda.empty_cache()
    return out


def _cpu_ceilings() -> dict[str, float]:
    import time

    def best_s(fn, reps: int = 5) -> float:
        fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return min(times)

    n = 512
    a, b = torch.randn(n, n), torch.randn(n, n)
    x = torch.randn(1 << 22)
    y = torch.empty_like(x)
    return {"bf16_matmul_tflops": 2 * n**3 / best_s(lambda: a @ b) / 1e12,
            "copy_gbps": 2 * x.numel() * 4 / best_s(lambda: y.copy_(x)) / 1e9}


def linear_params(cfg: ModelConfig) -> int:
    """Weights every token multiplies through (all linear layers and lm_head; not the embedding)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    per_layer = h * (cfg.q_size + 2 * cfg.kv_size) + cfg.q_size * h + 3 * h * i
    return cfg.num_layers * per_layer


def prefill_flops(cfg: ModelConfig, new: int, cached: int = 0) -> float:
    """FLOPs to compute `new` tokens after `cached` ones, causal attention counted exactly, plus one logits row."""
    dense = 2 * linear_params(cfg) * new
    ctx_sum = new * cached + new * (new + 1) / 2  # keys seen, summed over the new tokens
    attn = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * ctx_sum
    return dense + attn + 2 * cfg.hidden_size * cfg.vocab_size


def prefill_compute_s(cfg: ModelConfig, new: int, cached: int, rate: float, linear_rate: float | None = None,
                      attention_rate: float | None = None) -> float:
    """Seconds of prefill FLOPs: the decoder's projections at `linear_rate` (an FP8 model's FP8
    rate; None: `rate`), attention at `attention_rate` (FP8 attention's; None: `rate`), the logits row at `rate`."""
    dense = 2 * linear_params(cfg) * new
    head = 2 * cfg.hidden_size * cfg.vocab_size
    attn = prefill_flops(cfg, new, cached) - dense - head
    return dense / (linear_rate or rate) + attn / (attention_rate or rate) + head / rate


def weight_bytes(cfg: ModelConfig, dtype_bytes: int = 2, linear_dtype_bytes: int | None = None) -> float:
    """Bytes of weights one forward reads: linear layers (at `linear_dtype_bytes`, 1 for FP8
    projections; None: `dtype_bytes`) + lm_head (at `dtype_bytes`)."""
    lin = linear_dtype_bytes or dtype_bytes
    return linear_params(cfg) * lin + cfg.hidden_size * cfg.vocab_size * dtype_bytes


def kv_bytes(cfg: ModelConfig, tokens: int, dtype_bytes: int = 2) -> float:
    return 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * tokens * dtype_bytes


def throughput_floor_s(cfg: ModelConfig, lens_in: list[int], lens_out: list[int], rate: float, bw: float,
                       kv_dtype_bytes: int = 2, linear_rate: float | None = None) -> float:
    """Seconds an offline run cannot beat: every token's matmul and attention FLOPs at `rate`
    (the projections' at `linear_rate` when given: FP8), plus every decode step's KV read at `bw`
    (each output token after the first reads its request's whole context once). Weight reads
    are left out (hidden under compute at large batch), so this is a lower bound.
    """
    seconds = 0.0
    kv_tokens = 0
    per_token_linear = 2 * linear_params(cfg)
    for n_in, n_out in zip(lens_in, lens_out):
        seconds += prefill_compute_s(cfg, n_in, 0, rate, linear_rate)  # the prompt and the first token's logits
        for i in range(1, n_out):  # decodes: one token at context n_in + i
            kv_tokens += n_in + i
        ctx = (n_out - 1) * n_in + (n_out - 1) * n_out / 2
        rest = (n_out - 1) * 2 * cfg.hidden_size * cfg.vocab_size + 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers * ctx
        seconds += (n_out - 1) * per_token_linear / (linear_rate or rate) + rest / rate
    return seconds + kv_bytes(cfg, kv_tokens, kv_dtype_bytes) / bw


def load_floor_s(cfg: ModelConfig, reqs: list[tuple[float, list[int], int]], rate: float, bw: float,
                 kv_dtype_bytes: int = 2, linear_rate: float | None = None, block_size: int = 16) -> float:
    """Device seconds no engine can beat for an online workload of (arrival, prompt ids, output
    tokens) requests: `throughput_floor_s`'s count (FLOPs at `rate`, the projections' at
    `linear_rate`; every decode's KV read at `bw`), with each prompt's prefill reduced by the
    full blocks a perfect prefix cache holds from the requests before it (a block is cached once
    an earlier prompt had the same tokens up to its end; at least the last token is computed).
    Weight reads are left out (under compute in mixed steps), so it is a lower bound.

    floor / duration is the utilisation a perfect engine would have at that load: at 1 or more
    the offered load exceeds the GPU and every queue grows whatever the schedule."""
    seen: set[int] = set()
    seconds, kv_tokens = 0.0, 0.0
    per_token_linear = 2 * linear_params(cfg)
    per_ctx = 4 * cfg.num_heads * cfg.head_dim * cfg.num_layers  # attention FLOPs per (query, key) pair
    for _arrival, ids, n_out in reqs:
        n_in, h, cached = len(ids), 0, 0
        hit = True
        for b in range(n_in // block_size):
            h = hash((h, tuple(ids[b * block_size : (b + 1) * block_size])))
            if hit and h in seen and (b + 1) * block_size < n_in:
                cached = (b + 1) * block_size
            else:
                hit = False
            seen.add(h)
        seconds += prefill_compute_s(cfg, n_in - cached, cached, rate, linear_rate)
        ctx = (n_out - 1) * n_in + (n_out - 1) * n_out / 2  # keys the decodes read, summed
        kv_tokens += ctx
        rest = (n_out - 1) * 2 * cfg.hidden_size * cfg.vocab_size + per_ctx * ctx
        seconds += (n_out - 1) * per_token_linear / (linear_rate or rate) + rest / rate
    return seconds + kv_bytes(cfg, int(kv_tokens), kv_dtype_bytes) / bw


def git_commit() -> str:
    """FIRSTTOKEN_COMMIT when set (a device copy's git metadata can be stale), else git's HEAD."""
    if os.environ.get("FIRSTTOKEN_COMMIT"):
        return os.environ["FIRSTTOKEN_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "--short", "HEAD"], text=True).strip()
    except Exception:
        return "unknown"


def machine() -> str:
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        return f"{p.name}, {p.total_memory / 2**30:.0f} GiB, {p.multi_processor_count} SMs"
    return "cpu"


def header() -> dict[str, Any]:
    import triton

    return {
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": git_commit(),
        "machine": machine(),
        "torch": torch.__version__,
        "triton": triton.__version__,
    }


def md_table(rows: list[dict[str, Any]], cols: list[str]) -> str:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return "" if v is None else str(v)

    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(out)


def write_report(name: str, data: dict[str, Any], markdown: str) -> None:
    """Print JSON and markdown; also write both under $OUT when it is set."""
    text = json.dumps(data, indent=2, default=float)
    print(text)
    print(markdown)
    out = os.environ.get("OUT")
    if out:
        Path(out, f"{name}.json").write_text(text)
        Path(out, f"{name}.md").write_text(markdown + "\n")
