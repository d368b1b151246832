"""The engine with the Triton kernels (through Triton's CPU interpreter) still matches transformers."""

from __future__ import annotations

import pytest

from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import hf_greedy, prompt_set, run_prompts
from workers.engine import EngineConfig, LLMEngine

MAX_NEW = 6


@pytest.mark.slow
@pytest.mark.parametrize("compact", ["0", "1"])
def test_triton_kernels_greedy_matches_transformers(llama_dir, monkeypatch, compact):
    """compact=1: the prefill attention's compact grid (the default), its eager steps of several sequences
    (chunked prefills beside a prefix hit) included; 0: the grid per sequence (FIRSTTOKEN_PREFILL_COMPACT)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setenv("FIRSTTOKEN_PREFILL_COMPACT", compact)
    import kernels.decode_attention as da

    fused_calls = []
    real = da.decode_rope_attention_triton

    def counted(q, *args, **kwargs):
        fused_calls.append(q.shape[0])
        return real(q, *args, **kwargs)

    monkeypatch.setattr(da, "decode_rope_attention_triton", counted)  # bound by get_ops at engine start
    prompts = prompt_set(5, seed=21, min_len=3, max_len=40)
    prompts.append(prompts[-1][:30] + [7, 8, 9])  # shares 28 tokens (7 blocks) with the one before
    want = hf_greedy(llama_dir, prompts, MAX_NEW)
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32", kernel_backend="triton",
                                                 block_size=4, max_num_batched_tokens=48))
    assert eng.runner.ops.name == "triton"
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    done = run_prompts(eng, prompts, sp)
    assert [f.output_token_ids for f in done] == want
    assert done[5].usage.cached_prompt_tokens > 0  # a prefix hit went through the Triton prefill path
    # pure decode steps ran rope_and_cache inside the decode attention (a call a layer)
    assert fused_calls and max(fused_calls) <= 16


@pytest.mark.slow
def test_fp8_cache_v_layouts_give_the_same_tokens(llama_dir, monkeypatch):
    """An fp8 cache with its V keys innermost (kernels/kv_layout.py, an fp8 cache's default), and with K heads
    first beside it, gives the tokens the same cache in rows gives, through the Triton prefill (a prefix hit
    included), the fused rope + decode and chunked prefill; and the caches really are laid out so."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    from kernels.kv_layout import heads_first, v_keys_inner

    prompts = prompt_set(4, seed=5, min_len=3, max_len=40)
    prompts.append(prompts[-1][:30] + [11, 12])  # a prefix hit of 7 blocks
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = {}
    for layout, k_layout in (("rows", "nhd"), ("keys_inner", "nhd"), ("keys_inner", "hnd")):
        eng = LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32", kernel_backend="triton",
                                                     block_size=4, max_num_batched_tokens=32, kv_cache_dtype="fp8",
                                                     kv_cache_v_layout=layout, kv_cache_k_layout=k_layout))
        kc, vc = eng.runner.kv_caches[0]
        assert v_keys_inner(vc) == (layout == "keys_inner") and heads_first(kc) == (k_layout == "hnd")
        done = run_prompts(eng, prompts, sp)
        assert done[4].usage.cached_prompt_tokens > 0
        got[layout, k_layout] = [f.output_token_ids for f in done]
    assert got["rows", "nhd"] == got["keys_inner", "nhd"] == got["keys_inner", "hnd"]
