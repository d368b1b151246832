"""FP8 attention's rope, cache write and e4m3 cast in one launch (FIRSTTOKEN_FP8_ATTENTION_ROPE, on unless 0):
the layer must give what rope_and_cache, then the cast, give."""

from __future__ import annotations

import pytest
import torch

from tests.workers.engine.conftest import COMMON, _save, prompt_set
from workers.engine import EngineConfig, LLMEngine
from workers.engine.attention import AttentionMetadata


def test_a_bad_fp8_attention_rope_switch_is_refused_with_its_name(monkeypatch, tmp_path):
    monkeypatch.setenv("FIRSTTOKEN_FP8_ATTENTION_ROPE", "yes")
    with pytest.raises(ValueError, match="FIRSTTOKEN_FP8_ATTENTION_ROPE"):
        _fp8_engine(tmp_path)


def _fp8_engine(path_root) -> LLMEngine:
    """FP8 + fp8 KV with the PyTorch emulation of cuDNN's FP8 attention, 64-dim heads (cuDNN's path takes 64 and 128)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    path = path_root / "d64"
    if not path.exists():
        torch.manual_seed(5)
        _save(LlamaForCausalLM(LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512},
                                           tie_word_embeddings=False)).eval(), path)
    return LLMEngine(str(path), EngineConfig(device="cpu", dtype="float32", block_size=4, num_blocks=64,
                                             quantization="fp8", kv_cache_dtype="fp8", fp8_attention=True))


def _dense_forward(eng: LLMEngine, t: int) -> tuple[torch.Tensor, list]:
    """One uncached prompt of t tokens as a dense step: (logits, each layer's (k, v) cache)."""
    r = eng.runner
    ids = torch.tensor(prompt_set(1, seed=3, min_len=t, max_len=t)[0])
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t) + 8, num_decodes=0, num_decode_tokens=0, decode_block_tables=None,
        decode_seq_lens=None, prefill_block_tables=torch.arange(2, 2 + t // 4, dtype=torch.int32)[None],
        prefill_query_start_loc=torch.tensor([0, t], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([t], dtype=torch.int32), prefill_max_query_len=t, prefill_dense=True)
    with torch.inference_mode():
        hidden, residual = r.model(ids, torch.arange(t), r.cos_sin, r.kv_caches, meta)
        logits = r.model.compute_logits(hidden, residual)
    return logits, [(k.clone(), v.clone()) for k, v in r.kv_caches]


def test_fp8_attention_rope_gives_the_default_paths_logits_and_cache(monkeypatch, tmp_path):
    """The default (FIRSTTOKEN_FP8_ATTENTION_ROPE unset): a dense prompt's layers take the one-launch rope +
    cache write + cast (once a layer) and give the two-launch path's (=0) logits and KV cache to the bit (the
    references: the same math); where cuDNN refuses the shape, the layer runs the two-launch path, with the
    same result."""
    from kernels import cudnn_attention as ca

    t = 40
    monkeypatch.setenv("FIRSTTOKEN_FP8_ATTENTION_ROPE", "0")
    off = _fp8_engine(tmp_path)
    assert all(layer.self_attn.attn.dense_fp8_rope is None for layer in off.runner.model.layers)
    want, want_cache = _dense_forward(off, t)
    monkeypatch.delenv("FIRSTTOKEN_FP8_ATTENTION_ROPE")
    eng = _fp8_engine(tmp_path)
    layers = [layer.self_attn.attn for layer in eng.runner.model.layers]
    op = layers[0].dense_fp8_rope
    assert op is not None and all(a.dense_fp8_rope is op for a in layers)
    calls = []

    def counted(*args):
        calls.append(args[0].shape)
        return op(*args)

    for a in layers:
        a.dense_fp8_rope = counted
    got, got_cache = _dense_forward(eng, t)
    assert len(calls) == len(layers)
    assert torch.equal(got, want)
    for (k, v), (wk, wv) in zip(got_cache, want_cache):
        assert torch.equal(k.view(torch.uint8), wk.view(torch.uint8))
        assert torch.equal(v.view(torch.uint8), wv.view(torch.uint8))

    def refused(*args):
        raise ca.Unsupported("not this shape")

    for a in layers:
        a.dense_fp8_rope = refused
    eng2 = _fp8_engine(tmp_path)
    for a, b in zip(layers, (layer.self_attn.attn for layer in eng2.runner.model.layers)):
        b.dense_fp8_rope = a.dense_fp8_rope
    fallback, fallback_cache = _dense_forward(eng2, t)
    assert torch.equal(fallback, want)
    assert all(torch.equal(k.view(torch.uint8), wk.view(torch.uint8)) for (k, _), (wk, _) in
               zip(fallback_cache, want_cache))


def test_a_refused_fp8_graph_leaves_the_cache_unwritten(monkeypatch):
    """dense_attention_fp8_rope asks cuDNN for the graph before its launch writes anything: where cuDNN
    refuses the shape, Unsupported comes with the cache, q and k as they were, so the layer's fallback
    (rope_and_cache, then attention in bf16) starts from the step's own inputs."""
    from kernels import cudnn_attention as ca

    monkeypatch.setattr(ca, "_build", lambda *args: (_ for _ in ()).throw(RuntimeError("no engine for this graph")))
    monkeypatch.setattr(ca, "_GRAPHS", {})
    monkeypatch.setattr(ca, "_FAILED", {})
    launched = []
    monkeypatch.setattr("kernels.rope_cache._launch_tiles", lambda *args: launched.append(1))
    t, hq, hk, d = 6, 4, 2, 64
    qkv = torch.randn(t, (hq + 2 * hk) * d)
    q, k, v = ca.qkv_views(qkv, hq, hk, d)
    kc = torch.full((4, 4, hk, d), float("nan"))
    vc = kc.clone()
    before = qkv.clone()
    cs = torch.randn(16, d)
    with pytest.raises(ca.Unsupported, match="no engine for this graph"):
        ca.dense_attention_fp8_rope(q, k, v, d**-0.5, torch.arange(t), cs, kc, vc, torch.arange(t))
    assert not launched and torch.equal(qkv, before) and kc.isnan().all() and vc.isnan().all()
