"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2) over the paged KV cache.

q/k/v and gate/up projections are fused into single matrices at load time. Every op that the
Triton kernels replace goes through the `KernelOps` bound at construction.
"""

from __future__ import annotations

import os
from typing import Any

import torch
from torch import nn

from kernels.ops import KernelOps
from workers.engine.attention import AttentionMetadata, PagedAttention
from workers.engine.config import ModelConfig


class RMSNorm(nn.Module):
    def __init__(self, hidden: int, eps: float, ops: KernelOps) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden))
        self.eps = eps
        self.ops = ops
        # the op: ops.rms_norm, or ops.rms_norm_quant when an FP8 projection takes the output
        # (workers/engine/quantization.py): then the first element is (e4m3, scale)
        self.norm_fn = ops.rms_norm

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> tuple[Any, torch.Tensor]:
        # x, residual: [T, H] -> (normed(x + residual), x + residual)
        return self.norm_fn(x, self.weight, self.eps, residual)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: KernelOps) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.qkv_proj = nn.Linear(cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.attn = PagedAttention(ops, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.sliding_windows[layer])

    def forward(self, x: Any, positions: torch.Tensor, cos_sin: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        # x: [T, H], or (e4m3 [T, H], scale [T, 1]) before an FP8 qkv_proj
        cfg = self.cfg
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hk) * D]
        t = qkv.shape[0]
        q = qkv[:, : cfg.q_size].view(t, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        if self.attn.fuses_rope(meta, t):  # a pure decode step: rope and the cache write in its attention
            o = self.attn.decode_with_rope(q, k, v, positions, cos_sin, k_cache, v_cache, meta)
        elif (o8 := self.attn.dense_fp8_with_rope(q, k, v, positions, cos_sin, k_cache, v_cache, meta)) is not None:
            return self.o_proj(o8)  # one prompt's FP8 attention, rope and the cache write in its cast
        else:
            q, k = self.ops.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
            o = self.attn(q, k, v, k_cache, v_cache, meta)  # [T, Hq, D], or FP8 attention's (e4m3, descale)
            if isinstance(o, tuple):  # already quantized for the FP8 o_proj
                return self.o_proj(o)
        return self.o_proj(o.reshape(t, cfg.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        self.ops = ops
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.act_fn = ops.silu_and_mul  # or ops.silu_and_mul_quant before an FP8 down_proj

    def forward(self, x: Any) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, ops: KernelOps) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.self_attn = Attention(cfg, layer, ops)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        self.mlp = MLP(cfg, ops)

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None, positions: torch.Tensor,
                cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(h, positions, cos_sin, k_cache, v_cache, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class LlamaForCausalLM(nn.Module):
    """Decoder-only transformer; `forward` returns final hidden states, `compute_logits` the logits."""

    def __init__(self, cfg: ModelConfig, ops: KernelOps) -> None:
        super().__init__()
        self.cfg = cfg
        self.ops = ops
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, ops) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, ops)
        if cfg.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # set by quantize_fp8(lm_head=True): the lm_head as an Fp8Linear (the final norm then hands
        # it quantized activations, or at one row its GEMV applies the norm itself)
        self.fp8_head: nn.Module | None = None
        # a bf16/fp16 head on CUDA writes fp32 logits straight from its GEMM (FIRSTTOKEN_LOGITS_FP32_GEMM=0: the
        # head's GEMM in the model's dtype, then a cast, as before; an A/B switch)
        self.logits_fp32_gemm = os.environ.get("FIRSTTOKEN_LOGITS_FP32_GEMM") != "0"

    @property
    def lm_head_weight(self) -> torch.Tensor:
        # (an untied head quantized by quantize_fp8(lm_head=True) has no bf16 weight left: fp8_head)
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # input_ids, positions: [T] -> (last layer output [T, H], residual [T, H]), before the final norm
        x = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, cos_sin, kc, vc, meta)
        assert residual is not None
        return x, residual

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden, residual: [N, H] rows that sample -> logits [N, V] fp32 (final norm fused with the add).
        # out: an fp32 [N, V] tensor the logits are written to (a graph's shared output buffer), returned
        h, _ = self.norm(hidden, residual)
        if self.fp8_head is None and self.logits_fp32_gemm and h.is_cuda and h.dtype in (torch.bfloat16, torch.float16):
            # one GEMM that writes fp32 from its fp32 accumulator: no bf16 [N, V] tensor and no cast launch (at
            # N = 1000 the cast of Llama-3.1-8B's 128256-column logits took 0.39 ms of a 38.6 ms decode step on
            # the H200), and the logits are not rounded to bf16 on the way
            w = self.lm_head_weight
            if out is None:
                out = torch.empty((h.shape[0], w.shape[0]), dtype=torch.float32, device=h.device)
            return torch.mm(h, w.t(), out_dtype=torch.float32, out=out)
        logits = self.fp8_head(h) if self.fp8_head is not None else torch.nn.functional.linear(h, self.lm_head_weight)
        if out is None:
            return logits.float()
        return out.copy_(logits)  # the cast .float() does, into out
