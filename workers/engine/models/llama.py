"""The Llama family (Llama 2/3/3.1, Mistral, Qwen2) over the paged KV cache.

q/k/v and gate/up projections are fused into single matrices at load time. Every op that the
Triton kernels replace goes through the `KernelOps` bound at construction.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from torch import nn

from kernels.ops import KernelOps
from workers.engine.attention import AttentionMetadata, PagedAttention, split_decode
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
        q, k, v = self.project(x)
        return self.o_proj(self.attend(q, k, v, positions, cos_sin, k_cache, v_cache, meta))

    def project(self, x: Any) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        # x -> q [T, Hq, D], k, v [T, Hk, D] (views of one qkv_proj output)
        cfg = self.cfg
        qkv = self.qkv_proj(x)  # [T, (Hq + 2 Hk) * D]
        t = qkv.shape[0]
        q = qkv[:, : cfg.q_size].view(t, cfg.num_heads, cfg.head_dim)
        k = qkv[:, cfg.q_size : cfg.q_size + cfg.kv_size].view(t, cfg.num_kv_heads, cfg.head_dim)
        v = qkv[:, cfg.q_size + cfg.kv_size :].view(t, cfg.num_kv_heads, cfg.head_dim)
        return q, k, v

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor,
               cos_sin: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               meta: AttentionMetadata) -> Any:
        # rope, the cache write, attention -> o_proj's input: [T, Hq * D], or FP8 attention's (e4m3, descale)
        t = q.shape[0]
        if self.attn.fuses_rope(meta, t):  # a pure decode step: rope and the cache write in its attention
            o = self.attn.decode_with_rope(q, k, v, positions, cos_sin, k_cache, v_cache, meta)
        else:
            q, k = self.ops.rope_and_cache(q, k, v, positions, cos_sin, k_cache, v_cache, meta.slot_mapping)
            o = self.attn(q, k, v, k_cache, v_cache, meta)  # [T, Hq, D], or FP8 attention's (e4m3, descale)
            if isinstance(o, tuple):  # already quantized for the FP8 o_proj
                return o
        return o.reshape(t, self.cfg.q_size)


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
        # pure decode steps of at least this many sequences run as two halves on two CUDA streams
        # (None: never): one half's attention (bound by the KV cache's bytes) beside the other's GEMMs
        # (bound by FLOPs). FIRSTTOKEN_DECODE_OVERLAP=N[:free]: ":free" lets the halves' attentions run at
        # once; by default each waits for the other half's attention of the layer before.
        env = os.environ.get("FIRSTTOKEN_DECODE_OVERLAP", "0")
        n, _, mode = env.partition(":")
        self.overlap_min_batch: int | None = int(n) if int(n) > 0 else None
        self.overlap_serial_attention = mode != "free"

    @property
    def lm_head_weight(self) -> torch.Tensor:
        # (an untied head quantized by quantize_fp8(lm_head=True) has no bf16 weight left: fp8_head)
        return self.embed_tokens.weight if self.cfg.tie_word_embeddings else self.lm_head.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        # input_ids, positions: [T] -> (last layer output [T, H], residual [T, H]), before the final norm
        x = self.embed_tokens(input_ids)
        t = x.shape[0]
        if (self.overlap_min_batch is not None and t >= max(2, self.overlap_min_batch) and not meta.prefill_dense
                and meta.num_decode_tokens == t):
            return self._forward_halves(x, positions, cos_sin, kv_caches, meta)
        residual: torch.Tensor | None = None
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, positions, cos_sin, kc, vc, meta)
        assert residual is not None
        return x, residual

    def _forward_halves(self, x: torch.Tensor, positions: torch.Tensor, cos_sin: torch.Tensor,
                        kv_caches: list[tuple[torch.Tensor, torch.Tensor]],
                        meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """A pure decode step as two halves of its sequences, the first on the current stream, the second
        on a side stream (on a CPU one after the other), launched a layer at a time in turn. With
        overlap_serial_attention, a half's attention waits for the other half's attention before it,
        so the attentions alternate and each half's GEMMs run beside the other's attention."""
        at = x.shape[0] // 2
        metas = split_decode(meta, at)
        rows = (slice(0, at), slice(at, x.shape[0]))
        cuda = x.is_cuda
        streams = (torch.cuda.current_stream(x.device), _side_stream(x.device)) if cuda else (None, None)
        if cuda:
            streams[1].wait_stream(streams[0])  # the step's inputs
        xs: list[Any] = [x[r] for r in rows]
        res: list[Any] = [None, None]
        pos = [positions[r] for r in rows]
        attended: list[torch.cuda.Event | None] = [None, None]  # each half's latest attention
        for layer, (kc, vc) in zip(self.layers, kv_caches):
            sa = layer.self_attn
            for i in (0, 1):
                with torch.cuda.stream(streams[i]) if cuda else contextlib.nullcontext():
                    h, res[i] = layer.input_layernorm(xs[i], res[i])
                    q, k, v = sa.project(h)
                    other = attended[1 - i]
                    if self.overlap_serial_attention and other is not None:
                        streams[i].wait_event(other)
                    o = sa.attend(q, k, v, pos[i], cos_sin, kc, vc, metas[i])
                    if cuda:
                        attended[i] = torch.cuda.Event()
                        attended[i].record(streams[i])
                    h, res[i] = layer.post_attention_layernorm(sa.o_proj(o), res[i])
                    xs[i] = layer.mlp(h)
        if cuda:
            streams[0].wait_stream(streams[1])
        return torch.cat(xs), torch.cat(res)

    def compute_logits(self, hidden: torch.Tensor, residual: torch.Tensor,
                       out: torch.Tensor | None = None) -> torch.Tensor:
        # hidden, residual: [N, H] rows that sample -> logits [N, V] fp32 (final norm fused with the add).
        # out: an fp32 [N, V] tensor the logits are written to (a graph's shared output buffer), returned
        h, _ = self.norm(hidden, residual)
        logits = self.fp8_head(h) if self.fp8_head is not None else torch.nn.functional.linear(h, self.lm_head_weight)
        if out is None:
            return logits.float()
        return out.copy_(logits)  # the cast .float() does, into out


_SIDE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    """One side stream per device for every model of the process (torch keeps a cuBLAS workspace for each
    stream cuBLAS ran on)."""
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SIDE_STREAMS:
        _SIDE_STREAMS[idx] = torch.cuda.Stream(device=idx)
    return _SIDE_STREAMS[idx]
