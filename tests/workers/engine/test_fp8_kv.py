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
    assert not eng.stats().fp8_attention  # an fp8 cache without FP8 projections
    # quantized K/V perturb the logits a little, and this random tiny model's logits are nearly
    # flat: every first token agrees with transformers' (full precision) and half the whole
    # continuations do (a cache read wrongly agrees with nothing)
    assert all(g[0] == w[0] for g, w in zip(got, want)), (got, want)
    assert sum(g == w for g, w in zip(got, want)) >= 4, (got, want)


def test_kv_cache_dtype_is_checked():
    import pytest

    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineConfig(kv_cache_dtype="int4")


def test_fp8_attention_is_checked():
    """fp8_attention: None, True or False (the string "false" is not off), and on only with FP8 and an fp8 cache."""
    import pytest

    assert EngineConfig().fp8_attention is None
    EngineConfig(quantization="fp8", kv_cache_dtype="fp8", fp8_attention=True)
    EngineConfig(fp8_attention=False)
    with pytest.raises(ValueError, match="None, True or False"):
        EngineConfig(quantization="fp8", kv_cache_dtype="fp8", fp8_attention="false")
    for fields in ({"quantization": "fp8"}, {"kv_cache_dtype": "fp8"}):
        with pytest.raises(ValueError, match="fp8_attention needs"):
            EngineConfig(fp8_attention=True, **fields)


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


def test_fp8_attention_runs_a_dense_prompt_through_the_fp8_o_proj(tmp_path):
    """FP8 + fp8 KV with fp8_attention (the PyTorch emulation of cuDNN's FP8 forward on the CPU): a dense
    prefill step's attention comes out in e4m3 with its descale and goes into the FP8 o_proj as it is. Its
    logits against exact attention over the same e4m3 q/k/v (the cache's k/v; o_proj then quantizes per
    token): what P's and O's e4m3 rounding cost, well under a planted defect's (each token given the
    previous token's attention output). 64-dim heads (the FP8 path takes 64 and 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kernels.cudnn_attention import saturate_e4m3
    from tests.workers.engine.conftest import COMMON, _save
    from workers.engine.attention import AttentionMetadata, dense_causal_attention

    torch.manual_seed(5)
    path = _save(LlamaForCausalLM(LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512},
                                              tie_word_embeddings=False)).eval(), tmp_path / "d64")
    t = 40
    ids = torch.tensor(prompt_set(1, seed=3, min_len=t, max_len=t)[0])
    eng = LLMEngine(str(path), EngineConfig(device="cpu", dtype="float32", block_size=4, num_blocks=64,
                                            quantization="fp8", kv_cache_dtype="fp8", fp8_attention=True))
    r = eng.runner
    assert eng.stats().fp8_attention and eng.stats().kernel_backend == "torch"  # the emulation
    layers = [layer.self_attn.attn for layer in r.model.layers]
    fp8_op = layers[0].dense_fp8
    assert fp8_op is not None and all(a.dense_fp8 is fp8_op for a in layers)
    calls = []

    def fp8(*args):
        out = fp8_op(*args)
        calls.append(out)
        return out

    def exact_e4m3(q, k, v, scale):  # fp32 attention of the e4m3 values
        return dense_causal_attention(*(saturate_e4m3(x).float() for x in (q, k, v)), scale)

    def planted(*args):
        o8, descale = fp8_op(*args)
        return o8.roll(1, 0), descale

    meta = AttentionMetadata(
        slot_mapping=torch.arange(t), num_decodes=0, num_decode_tokens=0, decode_block_tables=None,
        decode_seq_lens=None, prefill_block_tables=torch.arange(t // 4, dtype=torch.int32)[None],
        prefill_query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([t], dtype=torch.int32), prefill_max_query_len=t, prefill_dense=True)
    logp = {}
    for name, op in (("fp8", fp8), ("exact_e4m3", exact_e4m3), ("planted", planted)):
        for a in layers:
            a.dense_fp8 = op
            a.dense_fp8_rope = None  # (rope_and_cache, then the op: tests/workers/engine/test_rope_variants.py
            # checks the one-launch form against it)
        with torch.inference_mode():
            hidden, residual = r.model(ids, torch.arange(t), r.cos_sin, r.kv_caches, meta)
            logp[name] = torch.log_softmax(r.model.compute_logits(hidden, residual), -1)
    assert len(calls) == len(layers)  # every layer's attention, once, in FP8
    o8, descale = calls[0]
    assert o8.dtype == torch.float8_e4m3fn and o8.shape == (t, 256) and descale.shape == (t, 1)
    ref = logp["exact_e4m3"]

    def kl(x):
        return float((ref.exp() * (ref - x)).sum(-1).mean())

    measured = {"fp8": kl(logp["fp8"]), "planted": kl(logp["planted"])}
    # measured: KL 0.081 nats (this random model's logits swing with any rounding), the planted defect 8.06
    assert 0 < measured["fp8"] < 0.03 * measured["planted"], measured
