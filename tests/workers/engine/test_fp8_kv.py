"""An fp8 (e4m3) KV cache: half the bytes per token, outputs close to the full-precision cache's."""

from __future__ import annotations

import torch

from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import hf_greedy, prompt_set, run_prompts
from workers.engine import EngineConfig, LLMEngine

MAX_NEW = 8


def run(path, prompts, **cfg) -> tuple[LLMEngine, list[list[int]]]:
    eng = LLMEngine(str(path), EngineConfig(device="cpu", dtype="float32", block_size=4, **cfg))
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return eng, [f.output_token_ids for f in run_prompts(eng, prompts, sp)]


def test_fp8_kv_cache_halves_bytes_and_tracks_full_precision(llama_dir):
    prompts = prompt_set(8, seed=21, min_len=5, max_len=60)
    want = hf_greedy(llama_dir, prompts, MAX_NEW)
    eng, got = run(llama_dir, prompts, kv_cache_dtype="fp8", num_blocks=64)
    full, _ = run(llama_dir, prompts[:1], num_blocks=64)
    k_cache = eng.runner.kv_caches[0][0]
    assert k_cache.dtype == torch.float8_e4m3fn
    assert eng.runner.kv_bytes_per_block() * 4 == full.runner.kv_bytes_per_block()  # fp32 model: 4 bytes -> 1
    assert eng.stats().kv_cache_dtype == "float8_e4m3fn" and full.stats().kv_cache_dtype == "float32"
    # quantized K/V perturb the logits a little, and this random tiny model's logits are nearly
    # flat: every first token agrees with transformers' (full precision) and half the whole
    # continuations do (a cache read wrongly agrees with nothing)
    assert all(g[0] == w[0] for g, w in zip(got, want)), (got, want)
    assert sum(g == w for g, w in zip(got, want)) >= 4, (got, want)


def test_kv_cache_dtype_is_checked():
    import pytest

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_v_layout_is_checked():
    """V stays in rows unless keys_inner is asked for (it measured slower on the GPU)."""
    import pytest

    assert EngineConfig().kv_cache_v_layout == "rows"
    with pytest.raises(ValueError, match="kv_cache_v_layout"):
        EngineConfig(kv_cache_v_layout="columns")
    with pytest.raises(ValueError, match="kv_cache_v_layout"):
        EngineConfig(kv_cache_v_layout="auto")


def test_torch_ops_read_a_keys_inner_v_cache(llama_dir):
    """The PyTorch ops index the cache's view, so a keys-inner V gives the rows layout's tokens
    exactly (fp32 cache, the CPU's kernels)."""
    prompts = prompt_set(3, seed=4, min_len=5, max_len=30)
    _, rows = run(llama_dir, prompts, num_blocks=64)
    eng, inner = run(llama_dir, prompts, num_blocks=64, kv_cache_v_layout="keys_inner")
    assert eng.runner.v_layout == "keys_inner" and eng.runner.kv_caches[0][1].stride(1) == 1
    assert inner == rows
