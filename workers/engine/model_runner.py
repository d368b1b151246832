"""Runs one scheduled step on the device: its inputs (workers/engine/step_inputs.py), the forward
(eager, or a replayed CUDA graph: workers/engine/cuda_graphs.py), logits where sampled, sampling."""

from __future__ import annotations

import gc
import logging
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from kernels.kv_layout import empty_kv_caches
from kernels.ops import KernelOps, get_ops, with_fp8_attention
from workers.engine.attention import AttentionMetadata
from workers.engine.config import EngineConfig, ModelConfig
from workers.engine.cuda_graphs import (
    DecodeGraphs,
    DenseGraphs,
    GraphContext,
    MixedGraphs,
    PrefillGraphs,
    capture_graphs,
)
from workers.engine.downloads import resolve_model, unknown_model_message
from workers.engine.errors import CheckpointError
from workers.engine.kv_sizing import auto_num_blocks, kv_bytes_per_block
from workers.engine.loader import load_checkpoint, random_model, resolve_dtype
from workers.engine.models.llama import LlamaForCausalLM
from workers.engine.models.rope import rope_cos_sin
from workers.engine.penalties import LogitsProcessor
from workers.engine.presets import PRESETS
from workers.engine.quantization import quantize_fp8
from workers.engine.sampled import PromptLogprobs, SampledTokens
from workers.engine.sampler import Sampler, SamplingBatch, sampling_batch, token_logprobs
from workers.engine.scheduler import SchedulerOutput
from workers.engine.sequence import Request
from workers.engine.step_inputs import (
    CacheLayout,
    HostBatch,
    PendingInputs,
    device_batch,
    fill_pending,
    host_batch,
    pending_inputs,
)

# the engine's guided-decoding masks of a step: sampling requests -> (rows, bitmasks) on the device
GuideMasks = Callable[[list[Request]], "tuple[torch.Tensor, torch.Tensor] | None"]
log = logging.getLogger(__name__)

# rows of prompt log-probabilities computed at once: a [rows, vocab] fp32 log-softmax each
PROMPT_LOGPROB_ROWS = 256


def pick_device(name: str | None) -> torch.device:
    if name is not None:
        return torch.device(name)
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


class ModelRunner:
    """Owns the model, the KV cache and the sampler on one device."""

    def __init__(self, model: str, config: EngineConfig) -> None:
        self.config = config
        self.closed = False  # close() gave the device memory back
        self.device = pick_device(config.device)
        backend = config.kernel_backend or ("triton" if self.device.type == "cuda" else "torch")
        self.ops: KernelOps = get_ops(backend)
        if self._fp8_attention(backend):
            self.ops = with_fp8_attention(self.ops)
        self.model, self.model_config = self._load(model)
        self.dtype = next(self.model.parameters()).dtype
        if config.quantization == "fp8":
            quantize_fp8(self.model, lm_head=config.fp8_lm_head)
        # whether FP8 dense attention is on, as it resolved (the ops have it and these heads take it)
        self.fp8_attention = self.model.layers[0].self_attn.attn.dense_fp8 is not None
        if self.device.type == "cuda":
            # what loading and quantizing freed (an FP8 engine's replaced bf16 projections, a
            # loader's temporaries) the caching allocator keeps reserved, and the KV sizing below
            # reads reserved memory as used (FP8 on the 8B shape: 92205 blocks, 90 GiB, ~19 GiB
            # short of what the H200 leaves them)
            gc.collect()
            torch.cuda.empty_cache()
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.cos_sin = rope_cos_sin(mc.head_dim, mc.rope_theta, mc.rope_scaling, self.max_model_len, self.device)
        self.num_blocks = config.num_blocks or auto_num_blocks(config, mc, self.device, self.kv_bytes_per_block(),
                                                               self.max_blocks_per_seq)
        # one extra block at index num_blocks: scratch slots for padded (graph) rows
        self.v_layout = config.kv_cache_v_layout
        self.kv_caches = [
            empty_kv_caches(self.num_blocks + 1, self.block_size, mc.num_kv_heads, mc.head_dim, self.kv_dtype,
                            self.device, self.v_layout, config.kv_cache_k_layout)
            for _ in range(mc.num_layers)
        ]
        self.layout = CacheLayout(self.device, self.block_size, self.num_blocks, self.max_blocks_per_seq)
        # long uncached prompts: dense causal attention (cuDNN) beats the paged kernel on CUDA
        self.dense_prefill_min_tokens = config.dense_prefill_min_tokens if self.device.type == "cuda" else None
        self.logits_processor = LogitsProcessor(mc.vocab_size, self.device)
        argmax = None  # torch's; on a GPU with the Triton ops kernels/argmax.py's (FIRSTTOKEN_TRITON_ARGMAX=0: torch's)
        if self.device.type == "cuda" and self.ops.name == "triton" and os.environ.get("FIRSTTOKEN_TRITON_ARGMAX") != "0":
            from kernels.argmax import argmax_triton as argmax
        self.sampler = Sampler(self.device, config.seed, self.logits_processor, argmax)
        self._generators: dict[str, torch.Generator] = {}
        self.last_path = ""  # how the last step ran: decode_graph, prefill_graph, mixed_graph, dense_graph or eager
        self.path_steps: dict[str, int] = {}  # steps run on each path (diagnostics, benchmarks)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        self.dense_graphs: DenseGraphs | None = None
        if self.device.type == "cuda":
            self._warm_up()
        if self.dense_prefill_min_tokens is not None:
            self._warm_dense_attention()
        if config.cuda_graphs and self.device.type == "cuda" and self.ops.name == "triton":
            max_bs = min(config.cuda_graph_max_batch or config.max_num_seqs, config.max_num_seqs)
            prefill_seqs = min(config.prefill_graph_max_seqs, config.max_num_seqs)
            ctx = self.graph_context(max(max_bs, prefill_seqs))  # the most rows a graph samples
            self.graphs = DecodeGraphs(ctx, max_bs)
            max_t = min(config.prefill_graph_max_tokens, config.max_num_batched_tokens)
            self.prefill_graphs = PrefillGraphs(ctx, max_t, prefill_seqs)
            mixed_t = min(config.mixed_graph_max_tokens, config.max_num_batched_tokens)
            if mixed_t > 0 and max_bs > 1:
                self.mixed_graphs = MixedGraphs(ctx, max_bs, mixed_t, min(config.mixed_graph_max_prefills,
                                                                            config.max_num_seqs))
            dense_t = min(config.dense_graph_max_tokens, config.max_num_batched_tokens, self.max_model_len)
            if (self.dense_prefill_min_tokens is not None and dense_t >= self.dense_prefill_min_tokens
                    and all(w is None for w in self.model_config.sliding_windows)):
                self.dense_graphs = DenseGraphs(ctx, self.dense_prefill_min_tokens, dense_t)
            capture_graphs(*(g for g in self._graph_sets() if g is not None))
        if self.device.type == "cuda" and config.num_blocks is None:
            free, total = torch.cuda.mem_get_info(self.device)
            over = (total - free) - total * config.gpu_memory_utilization
            if over > 1 << 30:  # what the KV sizing did not foresee (its activation margin is 1 GiB)
                log.warning("%.1f GiB of device memory in use beyond gpu_memory_utilization %.2f after the engine's "
                            "start (graphs, buffers, other processes): steps may run out of memory", over / 2**30,
                            config.gpu_memory_utilization)

    @torch.inference_mode()
    def _warm_up(self) -> None:
        """Compile every kernel variant serving can use, and run one eager mixed forward on the
        scratch block, before the first request: a compile mid-serving stalls a step ~1 s."""
        mc = self.model_config
        for window in sorted(set(mc.sliding_windows), key=lambda w: w or 0):
            self.ops.warm_up(*self.kv_caches[0], mc.num_heads, mc.head_dim**-0.5, window, self.dtype)
        dev = self.device
        n = 17  # one decode, then a 16-token prefill
        i32 = {"dtype": torch.int32, "device": dev}
        meta = AttentionMetadata(
            slot_mapping=torch.full((n,), self.layout.pad_slot, dtype=torch.int64, device=dev),
            num_decodes=1,
            num_decode_tokens=1,
            decode_block_tables=torch.full((1, 1), self.num_blocks, **i32),
            decode_seq_lens=torch.ones(1, **i32),
            prefill_block_tables=torch.full((1, 1), self.num_blocks, **i32),
            prefill_query_start_loc=torch.tensor([0, n - 1], **i32),
            prefill_seq_lens=torch.tensor([n - 1], **i32),
            prefill_max_query_len=n - 1,
        )
        positions = torch.cat([torch.zeros(1, dtype=torch.int64), torch.arange(n - 1)]).to(dev)
        ids = torch.zeros(n, dtype=torch.int64, device=dev)
        hidden, residual = self.model(ids, positions, self.cos_sin, self.kv_caches, meta)
        self.sampler.argmax(self.model.compute_logits(hidden[-1:], residual[-1:]))  # (its kernels too)
        self._warm_rope_cast()
        torch.cuda.synchronize(dev)

    def _warm_rope_cast(self) -> None:
        """Compile FP8 attention's rope + cache write + cast launch (FIRSTTOKEN_FP8_ATTENTION_ROPE; the warm-up's
        forward is no dense step) on two padding tokens."""
        attn = self.model.layers[0].self_attn.attn
        if self.ops.name != "triton" or attn.dense_fp8_rope is None:
            return
        from kernels.cudnn_attention import O_MARGIN, qkv_views
        from kernels.rope_cache import rope_cache_cast_triton

        mc, n = self.model_config, 2
        qkv = torch.zeros((n, mc.q_size + 2 * mc.kv_size), dtype=self.dtype, device=self.device)
        q, k, v = qkv_views(qkv, mc.num_heads, mc.num_kv_heads, mc.head_dim)
        positions = torch.zeros(n, dtype=torch.int64, device=self.device)
        slots = torch.full((n,), self.layout.pad_slot, dtype=torch.int64, device=self.device)
        rope_cache_cast_triton(q, k, v, positions, self.cos_sin, *self.kv_caches[0], slots, O_MARGIN)

    def _warm_dense_attention(self) -> None:
        """Load the dense attention library (cuDNN) now: its first call costs about a second."""
        from workers.engine.attention import dense_causal_attention

        mc = self.model_config
        n = self.dense_prefill_min_tokens or 1
        q = torch.randn(n, mc.num_heads, mc.head_dim, dtype=self.dtype, device=self.device)
        k = torch.randn(n, mc.num_kv_heads, mc.head_dim, dtype=self.dtype, device=self.device)
        dense_causal_attention(q, k, k, mc.head_dim**-0.5)
        if self.model.layers[0].self_attn.attn.dense_fp8 is not None:  # FP8 attention: every bucket's graph
            from kernels.cudnn_attention import EXACT_MAX, bucket_tokens, warm_up

            t0 = time.perf_counter()
            top = min(self.config.max_num_batched_tokens, self.max_model_len)
            built = warm_up(mc.num_heads, mc.num_kv_heads, mc.head_dim, mc.head_dim**-0.5, self.dtype, self.device,
                            top)
            log.info("FP8 dense attention: cuDNN graphs up to %d tokens built in %.1f s", built,
                     time.perf_counter() - t0)
            if built < bucket_tokens(top) and top > EXACT_MAX:
                log.warning("FP8 dense attention: the graphs past %d tokens were not built at start (no memory, or "
                            "cuDNN refused one); a longer prompt builds its bucket's at its first step, or runs its "
                            "attention in bf16", built)
            torch.cuda.empty_cache()  # the buckets' buffers, back for the graphs and steps
        torch.cuda.synchronize(self.device)

    # ---- loading and sizing -------------------------------------------------------------
    def _fp8_attention(self, backend: str) -> bool:
        """Whether dense prefill attention runs on FP8 tensor cores (EngineConfig.fp8_attention): asked
        (the PyTorch emulation on the "torch" ops), or left to the engine and cuDNN's FP8 forward runs here."""
        cfg = self.config
        if cfg.fp8_attention is False or cfg.quantization != "fp8" or cfg.kv_cache_dtype != "fp8":
            return False
        if backend == "torch":
            return bool(cfg.fp8_attention)
        from kernels.cudnn_attention import available

        why = available(self.device)
        if why is not None and cfg.fp8_attention:
            raise ValueError(f"fp8_attention: {why}")
        return why is None

    def _load(self, model: str) -> tuple[LlamaForCausalLM, ModelConfig]:
        if model in PRESETS:
            cfg = PRESETS[model]
            dtype = resolve_dtype(self.config.dtype or cfg.dtype, self.device)
            if self.device.type == "cpu" and dtype != torch.float32 and self.config.dtype is None:
                dtype = torch.float32
            return random_model(cfg, self.ops, self.device, dtype, seed=self.config.seed), cfg
        model = resolve_model(model)  # a downloadable model: its converted checkpoint directory
        if not Path(model).is_dir():
            raise CheckpointError(unknown_model_message(model))
        if self.config.dtype:
            dtype = resolve_dtype(self.config.dtype, self.device)
        elif self.device.type == "cpu":  # bf16/fp16 matmuls on a CPU are slow and round more: compute in fp32
            dtype = torch.float32
        else:
            dtype = None  # the checkpoint's
        model_, cfg = load_checkpoint(model, self.ops, self.device, dtype)
        return model_, cfg

    def kv_bytes_per_block(self) -> int:
        return kv_bytes_per_block(self.model_config, self.block_size, self.kv_dtype)

    # ---- one step -------------------------------------------------------------------------
    def host_inputs(self, out: SchedulerOutput) -> HostBatch:
        """The step's varlen batch on the host (step_inputs.host_batch)."""
        return host_batch(out, self.block_size)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Flatten the step's tokens into one varlen batch. Returns (input_ids, positions, meta, logit rows)."""
        batch = self.host_inputs(out)
        input_ids, positions, meta = device_batch(out, batch, self.device, self.dense_prefill_min_tokens)
        return input_ids, positions, meta, batch.logit_rows

    def sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        batch = sampling_batch(reqs, self.device, self.model_config.vocab_size, self._generators)
        batch.adjust = self.logits_processor.plan(reqs)
        return batch

    def close(self) -> None:
        """Drop the weights, KV cache and captured graphs so their device memory can be reused;
        idempotent. The runner serves no step after it.

        The tensors go with the last reference to them: the graphs (their private memory pool and
        static inputs and outputs) first, then the KV cache, RoPE tables, the model and per-request
        RNGs; then the caching allocator hands its free blocks back to the driver, so another
        engine (or process) on the device gets the memory."""
        if self.closed:
            return
        self.closed = True
        for graphs in self._graph_sets():
            if graphs is not None:
                graphs.close()
        self.graphs = self.prefill_graphs = self.mixed_graphs = self.dense_graphs = None
        if self.ops.dense_attention_fp8 is not None:
            from kernels.cudnn_attention import release

            release(self.device)  # cuDNN's graphs and their workspaces on this device
        self.kv_caches = []
        self.cos_sin = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]
        self._generators.clear()
        self.sampler = None  # type: ignore[assignment]
        self.logits_processor = None  # type: ignore[assignment]  (its tables: [slots, vocab] on the device)
        gc.collect()  # the graph sets and the model's modules can sit in reference cycles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing in flight still reads the memory
            torch.cuda.empty_cache()

    def _graph_sets(self) -> tuple[DecodeGraphs | PrefillGraphs | MixedGraphs | DenseGraphs | None, ...]:
        """The captured graph sets, in capture order (the dense prefills, the largest steps, first:
        the others reuse the shared pool's memory they freed)."""
        return self.dense_graphs, self.graphs, self.prefill_graphs, self.mixed_graphs

    def release(self, request_id: str) -> None:
        """Forget per-request state (its RNG, its penalty slot) once it has finished."""
        self._generators.pop(request_id, None)
        if self.logits_processor is not None:
            self.logits_processor.release(request_id)

    @property
    def prefill_graph_limits(self) -> tuple[int, int] | None:
        """(tokens, sequences) up to which a mixed step replays a prefill graph; None: no graphs."""
        pg = self.prefill_graphs
        return None if pg is None else (pg.buckets[-1], pg.max_seqs)

    @property
    def mixed_graph_limits(self) -> tuple[int, int, int] | None:
        """(prompt tokens, prompt chunks, decodes) up to which decodes beside prompt chunks replay a
        mixed graph; None: no mixed graphs."""
        mg = self.mixed_graphs
        return None if mg is None else (mg.token_buckets[-1], mg.max_prefills, mg.decode_buckets[-1])

    def pending_inputs(self, out: SchedulerOutput, prev: SampledTokens | None) -> PendingInputs | None:
        """Decode inputs that are tokens the previous step sampled but the host has not read yet."""
        return pending_inputs(out, None if prev is None else prev.device_tokens)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, prev: SampledTokens | None = None,
                guide: GuideMasks | None = None) -> SampledTokens:
        """Launch the step; return its sampled tokens (one per entry that samples, in order).

        Nothing here waits for the device: `SampledTokens.tolist()` does. Decode inputs still
        pending on `prev` (async scheduling) are read from its tokens on the device. On CUDA the
        step's work is bracketed by two timing events: `SampledTokens.device_seconds()`.
        `guide`: called with the sampling requests once the forward and logits are launched and
        before sampling; returns the guided rows' token bitmasks on the device (or None). The host
        computes them while the device runs the forward.
        """
        if self.device.type != "cuda":
            return self._execute(out, prev, guide)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        sampled = self._execute(out, prev, guide)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        sampled.timing = (start, end)
        return sampled

    def _execute(self, out: SchedulerOutput, prev: SampledTokens | None, guide: GuideMasks | None) -> SampledTokens:
        try:
            return self._run_step(out, prev, guide)
        finally:
            self.path_steps[self.last_path] = self.path_steps.get(self.last_path, 0) + 1

    def _run_step(self, out: SchedulerOutput, prev: SampledTokens | None, guide: GuideMasks | None) -> SampledTokens:
        sampling_reqs = [e.request for e in out.scheduled if e.samples]
        n_seq = len(out.scheduled)
        pending = self.pending_inputs(out, prev)
        plan = self._prompt_logprob_plan(out)
        prompt: PromptLogprobs | None = None
        if self.graphs is not None and out.num_decodes == n_seq and self.graphs.fits(n_seq):
            self.last_path = "decode_graph"
            logits = self.graphs.run(out, pending)
        elif not plan and self.dense_graphs is not None and self.dense_graphs.fits(out):
            self.last_path = "dense_graph"
            logits = self.dense_graphs.run(out, pending)
        elif not plan and self.prefill_graphs is not None and self.prefill_graphs.fits(out.num_batched_tokens, n_seq):
            self.last_path = "prefill_graph"
            logits = self.prefill_graphs.run(out, pending)
        elif not plan and self.mixed_graphs is not None and self.mixed_graphs.fits(out):
            self.last_path = "mixed_graph"
            hidden, residual = self.mixed_graphs.run(out, pending)
            logits = self.model.compute_logits(hidden, residual)
        else:  # (a step that scores prompt tokens runs eagerly: the graphs keep logits of sampled rows only)
            self.last_path = "eager"
            input_ids, positions, meta, logit_rows = self.prepare(out)
            fill_pending(input_ids, pending)
            hidden, residual = self.model(input_ids, positions, self.cos_sin, self.kv_caches, meta)
            if plan:
                prompt = self._prompt_logprobs(hidden, residual, plan)
            if len(logit_rows) == 0:
                return SampledTokens(None, prompt=prompt) if prompt else SampledTokens.empty()
            rows = torch.from_numpy(logit_rows).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows], residual[rows])
        if out.block_copies:
            self.copy_blocks(out.block_copies)
        if out.forks:  # each forked follower samples from its leader's logits row (after the entries' rows)
            at = {id(r): i for i, r in enumerate(sampling_reqs)}
            idx = self._index([at[id(lead)] for _, lead in out.forks])
            logits = torch.cat([logits, logits.index_select(0, idx)])
            sampling_reqs = sampling_reqs + [f for f, _ in out.forks]
        if not sampling_reqs:
            return SampledTokens(None, prompt=prompt) if prompt else SampledTokens.empty()
        batch = self.sampling_batch(sampling_reqs)
        if guide is not None:
            batch.guide = guide(sampling_reqs)
        tokens = self.sampler(logits, batch)
        asked = [i for i, r in enumerate(sampling_reqs) if r.sampling.logprobs is not None]
        if not asked:
            return SampledTokens(tokens, prompt=prompt)
        # only the rows that asked: a log-softmax over the vocabulary is [rows, V] fp32
        k = max(sampling_reqs[i].sampling.logprobs for i in asked)  # type: ignore[type-var]
        if len(asked) < len(sampling_reqs):
            idx = torch.tensor(asked, dtype=torch.int64).to(self.device, non_blocking=True)
            lps = token_logprobs(logits.index_select(0, idx), tokens.index_select(0, idx), k)
        else:
            lps = token_logprobs(logits, tokens, k)
        return SampledTokens(tokens, lps, asked, prompt)

    def _index(self, values: list[int]) -> torch.Tensor:
        """An int64 index on the device, copied from pinned memory (never waits for the stream)."""
        return torch.tensor(values, dtype=torch.int64, pin_memory=self.device.type == "cuda").to(
            self.device, non_blocking=True)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole KV blocks (source, destination) in every layer, in stream order."""
        src = self._index([a for a, _ in pairs])
        dst = self._index([b for _, b in pairs])
        for k, v in self.kv_caches:
            k.index_copy_(0, dst, k.index_select(0, src))
            v.index_copy_(0, dst, v.index_select(0, src))

    @staticmethod
    def _prompt_logprob_plan(out: SchedulerOutput) -> list[tuple[Request, int, int, int]]:
        """(request, first position, its flattened row, rows) of each prompt chunk of this step
        whose request asked for prompt log-probabilities: position p's logits score token p + 1,
        up to the last prompt token (whose logits sample the first output token instead)."""
        plan, row = [], 0
        for e in out.scheduled:
            req = e.request
            if req.sampling.prompt_logprobs is not None:
                start = e.num_computed_tokens
                end = min(start + e.num_new_tokens, req.num_prompt_tokens - 1)
                if end > start:
                    plan.append((req, start, row, end - start))
            row += e.num_new_tokens
        return plan

    def _prompt_logprobs(self, hidden: torch.Tensor, residual: torch.Tensor,
                         plan: list[tuple[Request, int, int, int]]) -> PromptLogprobs:
        rows = torch.from_numpy(np.concatenate([np.arange(r, r + n) for _, _, r, n in plan])).to(self.device)
        targets = torch.tensor([t for req, s, _, n in plan for t in req.token_ids[s + 1 : s + 1 + n]],
                               dtype=torch.int64).to(self.device)
        k = max(req.sampling.prompt_logprobs for req, _, _, _ in plan)  # type: ignore[type-var]
        parts = []
        for i in range(0, rows.shape[0], PROMPT_LOGPROB_ROWS):
            r = rows[i : i + PROMPT_LOGPROB_ROWS]
            parts.append(token_logprobs(self.model.compute_logits(hidden[r], residual[r]),
                                        targets[i : i + PROMPT_LOGPROB_ROWS], k))
        return tuple(torch.cat(p) for p in zip(*parts)), [(req, s, n) for req, s, _, n in plan]

    def graph_context(self, logit_rows: int) -> GraphContext:
        """What the CUDA graphs capture and replay: the model's forward over this runner's KV
        cache, its logits (rows of one fp32 buffer of `logit_rows` rows: the most any graph
        samples), the cache layout, and the attention kernels' split choices."""
        mc = self.model_config

        def forward(input_ids: torch.Tensor, positions: torch.Tensor,
                    meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
            return self.model(input_ids, positions, self.cos_sin, self.kv_caches, meta)

        def prefill_splits(batch: int, tokens: int, ctx_bound: int) -> int:
            # (the count does not depend on a layer's sliding window)
            return self.ops.prefill_splits(self.dtype, mc.num_heads, self.kv_caches[0][0], batch, tokens, tokens,
                                           ctx_bound, None)

        logits_buf = torch.empty((logit_rows, mc.vocab_size), dtype=torch.float32, device=self.device)

        def logits(hidden: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
            # (runs as a graph is captured, not at replay)
            if hidden.shape[0] > logit_rows:
                raise ValueError(f"a graph samples {hidden.shape[0]} rows; its logits buffer holds {logit_rows}")
            return self.model.compute_logits(hidden, residual, logits_buf[: hidden.shape[0]])

        return GraphContext(self.layout, forward, logits, self.decode_num_splits, prefill_splits)

    def decode_num_splits(self, batch: int) -> int:
        """Flash-decoding splits for a graph-captured batch: enough programs to fill the GPU."""
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        progs = batch * self.model_config.num_kv_heads
        want = math.ceil(2 * sms / progs)
        return int(max(1, min(want, 32, self.max_blocks_per_seq)))
