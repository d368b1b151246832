"""Model and engine configuration."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from workers.engine.errors import CheckpointError

SUPPORTED_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
}


@dataclass(frozen=True)
class ModelConfig:
    """The shape and numerics of a Llama-family model, read from a Hugging Face `config.json`."""

    architecture: str  # "llama" | "mistral" | "qwen2"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_scaling: dict[str, Any] | None = None  # e.g. {"rope_type": "llama3", "factor": 8.0, ...}
    max_position_embeddings: int = 4096
    # per-layer sliding window (None: full attention); Mistral sets it on every layer
    sliding_windows: tuple[int | None, ...] = ()
    qkv_bias: bool = False  # Qwen2
    o_bias: bool = False
    tie_word_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    dtype: str = "bfloat16"  # the checkpoint's dtype

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise CheckpointError("one sliding-window entry per layer expected")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def num_params(self) -> int:
        """Parameter count (embeddings and lm_head included)."""
        h, i, v = self.hidden_size, self.intermediate_size, self.vocab_size
        attn = h * (self.q_size + 2 * self.kv_size) + self.q_size * h
        mlp = 3 * h * i
        per_layer = attn + mlp + 2 * h
        emb = v * h * (1 if self.tie_word_embeddings else 2)
        return self.num_layers * per_layer + emb + h

    @classmethod
    def from_hf_dict(cls, d: dict[str, Any], generation_config: dict[str, Any] | None = None) -> ModelConfig:
        """Build from a Hugging Face config dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        archs = d.get("architectures") or []
        arch = next((SUPPORTED_ARCHITECTURES[a] for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            mt = d.get("model_type")
            arch = mt if mt in SUPPORTED_ARCHITECTURES.values() else None
        if arch is None:
            raise CheckpointError(
                f"unsupported architecture {archs or d.get('model_type')!r}; "
                f"supported: {sorted(SUPPORTED_ARCHITECTURES)}"
            )
        if d.get("hidden_act", "silu") != "silu":
            raise CheckpointError(f"unsupported hidden_act {d.get('hidden_act')!r}; only silu")
        if d.get("mlp_bias"):
            raise CheckpointError("mlp_bias=true is not supported")
        n_layers = int(d["num_hidden_layers"])
        n_heads = int(d["num_attention_heads"])
        head_dim = int(d.get("head_dim") or d["hidden_size"] // n_heads)

        rope = d.get("rope_parameters") or {}
        rope_theta = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        scaling = d.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            rtype = scaling.get("rope_type", scaling.get("type", "default"))
            if rtype not in ("default", "llama3", "linear"):
                raise CheckpointError(f"unsupported rope scaling type {rtype!r}; supported: llama3, linear")
            scaling["rope_type"] = rtype
            if rtype == "default":
                scaling = None

        window = d.get("sliding_window")
        if arch == "qwen2":
            use = bool(d.get("use_sliding_window", False))
            max_window_layers = int(d.get("max_window_layers", n_layers))
            windows = tuple(
                int(window) if use and window and i >= max_window_layers else None for i in range(n_layers)
            )
        else:
            windows = (int(window) if window else None,) * n_layers
        layer_types = d.get("layer_types")
        if layer_types and window:
            windows = tuple(int(window) if t == "sliding_attention" else None for t in layer_types)

        eos: list[int] = []
        for src in (generation_config or {}, d):
            e = src.get("eos_token_id")
            if e is None:
                continue
            for x in e if isinstance(e, list) else [e]:
                if int(x) not in eos:
                    eos.append(int(x))
        attention_bias = bool(d.get("attention_bias", False))
        return cls(
            architecture=arch,
            vocab_size=int(d["vocab_size"]),
            hidden_size=int(d["hidden_size"]),
            intermediate_size=int(d["intermediate_size"]),
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=int(d.get("num_key_value_heads") or n_heads),
            head_dim=head_dim,
            rms_norm_eps=float(d.get("rms_norm_eps", 1e-5)),
            rope_theta=rope_theta,
            rope_scaling=scaling,
            max_position_embeddings=int(d.get("max_position_embeddings", 4096)),
            sliding_windows=windows,
            qkv_bias=arch == "qwen2" or attention_bias,
            o_bias=attention_bias and arch != "qwen2",
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            bos_token_id=d.get("bos_token_id"),
            eos_token_ids=tuple(eos),
            dtype=str(d.get("torch_dtype") or d.get("dtype") or "bfloat16"),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read `config.json` (and `generation_config.json` when present) from a checkpoint directory."""
        p = Path(path)
        cfg = p / "config.json"
        if not cfg.is_file():
            raise CheckpointError(f"{p}: no config.json (is this a Hugging Face checkpoint directory?)")
        gen = p / "generation_config.json"
        gen_d = json.loads(gen.read_text()) if gen.is_file() else None
        return cls.from_hf_dict(json.loads(cfg.read_text()), gen_d)


@dataclass
class EngineConfig:
    """How the engine runs: KV cache size, batching limits, kernels, device."""

    # tokens per KV-cache block; None: 64 with an fp8 KV cache, else 16. Blocks of 64 with an fp8 cache: each
    # (block, head, dim) of keys-inner V is one 64-byte run and a decode key tile one block-table entry; decode
    # attention at B = 1000, context 1500 read 2898-2961 GB/s against 2284 for blocks of 16 with V in rows on an
    # H100 with 40 SMs held (the H200's bandwidth per SM), 98-100% of its copy rate
    # (bench/results/2026-12-07-session22.md). A cached prefix is then reused in steps of 64 tokens.
    block_size: int | None = None
    num_blocks: int | None = None  # None: sized from free device memory (CUDA) or cpu_kv_cache_tokens
    gpu_memory_utilization: float = 0.90  # share of total GPU memory the engine may use
    cpu_kv_cache_tokens: int = 65536  # KV capacity on CPU when num_blocks is None
    max_num_batched_tokens: int = 8192  # token budget of one step (prefill chunks + decodes)
    # most requests running at once: 512 ran the offline throughput bench at 11.8k tok/s against
    # 11.1k with 256 on an H200 (larger decode GEMMs; bench/results/2026-11-30-engine.md, run 10)
    max_num_seqs: int = 512
    # with a full batch, admit waiting requests only once this many slots are free
    # (None: max_num_seqs // 8); 1 admits each request as soon as a slot frees
    admission_batch: int | None = None
    # priority ages: a request that has waited this long (seconds since it arrived) is admitted
    # next whatever its priority, oldest first, so that low-priority work is late, never starved
    # (and never pins its queue partition's commit). None: strict priority.
    priority_max_wait_s: float | None = 30.0
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # admission keeps free KV blocks for this share of every running request's remaining output (up to its
    # max_tokens); 1.0: every admitted request runs to its end with no preemption (TensorRT-LLM's
    # GUARANTEED_NO_EVICT); 0.0: admit while the prompt fits, preempting (and later recomputing) the newest
    # request when blocks run out; "auto" (the default): 0.85 x the share of max_tokens that finished requests
    # used, from 1.0 before any has ended (workers.engine.scheduler.AdaptiveReserve). In the offline throughput
    # run on an H100 (1000 x 1000 + 1000, KV room for ~970k tokens) 0.0 preempted 405 times and recomputed
    # ~560k tokens: 13,023 output tok/s against 14,448 with 0.85, 32 preemptions
    # (bench/results/2026-12-07-session24-throughput-*-h100-675e8f1.json); on an H200's pool (room for 1.9M)
    # bench/sim_schedule.py models every choice but 1.0 alike
    kv_reserve: float | str = "auto"
    enable_prefix_caching: bool = True
    kernel_backend: str | None = None  # "triton" | "torch"; None: triton on CUDA, torch elsewhere
    cuda_graphs: bool = True  # capture the decode step (CUDA + triton only)
    cuda_graph_max_batch: int | None = None  # None: max_num_seqs
    # steps of at most this many tokens and sequences replay a captured graph (CPU launch cost
    # dominates them); larger steps run eagerly
    prefill_graph_max_tokens: int = 1024
    prefill_graph_max_seqs: int = 16
    # steps of decodes (any number up to cuda_graph_max_batch) beside at most mixed_graph_max_prefills
    # prompt chunks of at most mixed_graph_max_tokens tokens in all replay a mixed graph (decodes
    # through the decode kernel, the chunks through the prefill kernel); 0: such steps run eagerly.
    # Larger steps are GPU-bound (on the H200 ~25 ms of work at 1024 bf16 tokens): their launches
    # overlap the device under async scheduling, and a graph would pad them to a bucket
    mixed_graph_max_tokens: int = 1024
    mixed_graph_max_prefills: int = 8
    # one uncached prompt of at least this many tokens uses dense causal attention (CUDA); None: never
    dense_prefill_min_tokens: int | None = 1025
    # such a prompt of at most this many tokens (and at least dense_prefill_min_tokens) replays a
    # captured graph (cuda_graphs.DenseGraphs, buckets every 128 tokens) rather than running eagerly:
    # its first token no longer waits on the host launching ~500 kernels; 0: never
    dense_graph_max_tokens: int = 2048
    # overlap the host's work for the next step (schedule, inputs, post-processing) with the
    # device running this one; the next step's decodes read the sampled tokens on the device.
    # None: on for CUDA, off elsewhere (the CPU computes synchronously: nothing to overlap)
    async_scheduling: bool | None = None
    dtype: str | None = None  # None: the checkpoint's dtype (bf16 on CUDA, fp32 on CPU if it can't)
    # "auto": the KV cache holds the model's dtype. "fp8": float8 e4m3, unscaled (K/V of Llama-family
    # models sit well inside its +-448 range): half the bytes, so twice the tokens in the same
    # memory and half the KV reading per decode; greedy tokens may then differ from transformers'
    kv_cache_dtype: str = "auto"
    # how the V cache lies in memory (kernels/kv_layout.py): "rows" (as K: a key's head_dim values
    # together) or "keys_inner" (each block's keys together for each head and dim: the Triton
    # attention then loads an fp8 V tile as it loads K, not a byte at a time). None: keys_inner with an fp8
    # KV cache (with blocks of 64, above), else rows. At blocks of 16 keys_inner was no faster than rows on an
    # H100 (bench/results/2026-12-06-v-layout-h100.md): its runs were 16 bytes
    kv_cache_v_layout: str | None = None
    # how K (and V in rows) lies in memory (kernels/kv_layout.py): "nhd" (a block's keys outermost) or "hnd"
    # (heads first: one head's block one run of block_size x head_dim values). Decode attention over blocks of 64,
    # keys-inner V, B = 1000, context 1500 on an H100: 3037 against 2983 GB/s, 3017 against 2949 with 40 SMs held
    # (bench/results/2026-12-07-session23-blocks-tiles-*)
    kv_cache_k_layout: str = "nhd"
    # None: the checkpoint's weights as they are. "fp8": W8A8, e4m3 weights (one scale per output
    # channel, made at load) and activations quantized per token at run time, in every projection
    # of the decoder layers (workers/engine/quantization.py); greedy tokens may then differ
    quantization: str | None = None
    # with quantization "fp8": the lm_head in FP8 too (its weight bytes halved: of an 8B model's
    # decode step at batch 1 on an H200, ~0.12 of the bf16 head's 0.24 ms), at a cost in the logits' accuracy
    # (bench/bench_fp8_quality.py --lm-head); off by default, as in vLLM and TensorRT-LLM
    fp8_lm_head: bool = False
    # with quantization "fp8" and an fp8 KV cache: one uncached prompt's dense causal attention on FP8
    # tensor cores (cuDNN's sdpa_fp8, kernels/cudnn_attention.py; q/k/v cast to e4m3 as the cache stores
    # k/v, the output quantized for the FP8 o_proj), as TensorRT-LLM's FP8 context attention. None: where
    # it runs (CUDA sm90+, the nvidia-cudnn-frontend package); True: required; False: bf16 attention.
    # On an H100, one layer's kernel: 917 against 611 TFLOP/s at 32768 tokens, 868 against 571 at 8192,
    # its output 6% RMS from the bf16 one's over an fp8 cache; TTFT 8192 / 32768 127 / 743 ms against
    # 137 / 902 (bench/results/2026-12-06-session12-fp8-attention-h100.md)
    fp8_attention: bool | None = None
    # a time-per-output-token target (ms): while requests decode, each step computes only the
    # prefill tokens that keep it under this (a cost model fitted to measured steps); None: every
    # step takes max_num_batched_tokens. Lower: smoother decoding, later first tokens under load
    tpot_target_ms: float | None = None
    device: str | None = None  # None: cuda when available, else cpu
    seed: int = 0  # seed of the engine-wide RNG used by unseeded sampling
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_cache_dtype not in ("auto", "fp8"):
            raise ValueError("kv_cache_dtype must be 'auto' or 'fp8'")
        fp8_kv = self.kv_cache_dtype == "fp8"
        if self.block_size is None:
            self.block_size = 64 if fp8_kv else 16
        if self.kv_cache_v_layout is None:
            self.kv_cache_v_layout = "keys_inner" if fp8_kv else "rows"
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError("block_size must be a power of two")
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError("num_blocks must be positive")
        if self.kernel_backend not in (None, "torch", "triton"):
            raise ValueError("kernel_backend must be 'torch' or 'triton'")
        if self.kv_cache_v_layout not in ("rows", "keys_inner"):
            raise ValueError("kv_cache_v_layout must be 'rows' or 'keys_inner'")
        if self.kv_cache_k_layout not in ("nhd", "hnd"):
            raise ValueError("kv_cache_k_layout must be 'nhd' or 'hnd'")
        if self.kv_reserve != "auto" and not (isinstance(self.kv_reserve, int | float)
                                              and not isinstance(self.kv_reserve, bool)
                                              and 0.0 <= self.kv_reserve <= 1.0):
            raise ValueError(f"kv_reserve must be in [0, 1] or 'auto', not {self.kv_reserve!r}")
        if self.tpot_target_ms is not None and self.tpot_target_ms <= 0:
            raise ValueError("tpot_target_ms must be positive")
        if self.dense_graph_max_tokens < 0:
            raise ValueError("dense_graph_max_tokens must be >= 0")
        if self.mixed_graph_max_tokens < 0 or self.mixed_graph_max_prefills < 1:
            raise ValueError("mixed_graph_max_tokens must be >= 0 and mixed_graph_max_prefills >= 1")
        if self.quantization not in (None, "fp8"):
            raise ValueError("quantization must be None or 'fp8'")
        if self.fp8_lm_head and self.quantization != "fp8":
            raise ValueError("fp8_lm_head needs quantization='fp8'")
        if self.fp8_attention not in (None, True, False):  # a string "false" would read as on
            raise ValueError("fp8_attention must be None, True or False")
        if self.fp8_attention and (self.quantization != "fp8" or self.kv_cache_dtype != "fp8"):
            raise ValueError("fp8_attention needs quantization='fp8' and kv_cache_dtype='fp8'")
