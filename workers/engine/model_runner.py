"""Runs one scheduled step on the device: flatten the batch, forward, logits where sampled, sample."""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from kernels.ops import KernelOps, get_ops
from workers.engine.attention import AttentionMetadata
from workers.engine.config import EngineConfig, ModelConfig
from workers.engine.cuda_graphs import DecodeGraphs, MixedGraphs, PrefillGraphs, capture_graphs
from workers.engine.downloads import resolve_model, unknown_model_message
from workers.engine.errors import CheckpointError
from workers.engine.loader import load_checkpoint, random_model, resolve_dtype
from workers.engine.models.llama import LlamaForCausalLM
from workers.engine.models.rope import rope_cos_sin
from workers.engine.presets import PRESETS
from workers.engine.quantization import quantize_fp8
from workers.engine.sampler import Sampler, SamplingBatch, token_logprobs
from workers.engine.scheduler import SchedulerOutput
from workers.engine.sequence import Request

log = logging.getLogger(__name__)


class SampledTokens:
    """One launched step's sampled token ids (and, when a request asked, their log-probabilities):
    on the device, with their copy to the host in flight."""

    def __init__(self, tokens: torch.Tensor | None, logprobs: tuple[torch.Tensor, ...] | None = None,
                 rows: list[int] | None = None, prompt: PromptLogprobs | None = None) -> None:
        # tokens: [N] int64 on the device, one per entry that samples; logprobs: sampler.token_logprobs'
        # of the rows `rows` (None: all of them); prompt: the step's prompt log-probabilities
        self.device_tokens = tokens
        self._lp_rows = rows
        self._plan = None if prompt is None else prompt[1]
        self._event: torch.cuda.Event | None = None
        self._host, self._host_lp, self._host_prompt = tokens, logprobs, None if prompt is None else prompt[0]
        first = tokens if tokens is not None else None if prompt is None else prompt[0][0]
        if first is not None and first.is_cuda:  # copies to the host in flight, then one event for them all
            self._host = None if tokens is None else _to_host(tokens)
            self._host_lp = None if logprobs is None else tuple(map(_to_host, logprobs))
            self._host_prompt = None if prompt is None else tuple(map(_to_host, prompt[0]))
            self._event = torch.cuda.Event()
            self._event.record()

    # CUDA events recorded before and after the step's work (ModelRunner.execute); None on a CPU
    timing: tuple[torch.cuda.Event, torch.cuda.Event] | None = None

    @classmethod
    def empty(cls) -> SampledTokens:
        return cls(None)

    def device_seconds(self) -> float | None:
        """The step's time on the device, from the stream reaching its first kernel to its last
        (waits for it): exact under async scheduling, where the host's clock sees the step only
        when it reads it back. None without timing events (a CPU)."""
        if self.timing is None:
            return None
        start, end = self.timing
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def __len__(self) -> int:
        return 0 if self.device_tokens is None else self.device_tokens.shape[0]

    def tolist(self) -> list[int]:
        """Wait for the step (only it, not the steps launched after it) and return its tokens."""
        if self._event is not None:
            self._event.synchronize()
        return [] if self._host is None else self._host.tolist()

    def prompt_logprobs(self) -> Iterator[tuple[Request, int, list[RowLogprobs]]]:
        """(request, first position, a RowLogprobs per prompt token after it) of each prompt chunk
        this step computed for a request that asked; after `tolist`."""
        if self._host_prompt is None or self._plan is None:
            return
        chosen, top_lp, top_ids = (t.tolist() for t in self._host_prompt)
        at = 0
        for req, start, n in self._plan:
            yield req, start, list(zip(chosen[at : at + n], top_ids[at : at + n], top_lp[at : at + n]))
            at += n

    def logprobs(self) -> list[RowLogprobs | None] | None:
        """Per sampled row, its RowLogprobs (None for a row whose request did not ask); None when
        no request of the step asked. After `tolist`."""
        if self._host_lp is None or self._host is None:
            return None
        out: list[RowLogprobs | None] = [None] * self._host.shape[0]
        rows = range(len(out)) if self._lp_rows is None else self._lp_rows
        for r, lp, lps, ids in zip(rows, *(t.tolist() for t in self._host_lp)):
            out[r] = (lp, ids, lps)
        return out


# a token's log-probability, then the k likeliest ids and their log-probabilities (k: the step's largest ask)
RowLogprobs = tuple[float, list[int], list[float]]
PromptLogprobs = tuple[tuple[torch.Tensor, ...], list[tuple[Request, int, int]]]  # (tensors, [(req, start, rows)])

# rows of prompt log-probabilities computed at once: a [rows, vocab] fp32 log-softmax each
PROMPT_LOGPROB_ROWS = 256


def _to_host(t: torch.Tensor) -> torch.Tensor:
    """A pinned host copy of a device tensor, in flight on the current stream."""
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    return host


@dataclass
class PendingInputs:
    """Decode rows whose input token is still on the device: input_ids[dst[i]] = tokens[src[i]]."""

    tokens: torch.Tensor  # [N] int64: the previous step's sampled tokens, on the device
    dst: list[int]  # token rows of this step (decodes come first: row = entry index)
    src: list[int]  # rows of `tokens`


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
        self.model, self.model_config = self._load(model)
        self.dtype = next(self.model.parameters()).dtype
        if config.quantization == "fp8":
            quantize_fp8(self.model, config.fp8_weight_group, act_group=config.fp8_act_group)
        self.kv_dtype = torch.float8_e4m3fn if config.kv_cache_dtype == "fp8" else self.dtype
        mc = self.model_config
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        self.block_size = config.block_size
        self.max_blocks_per_seq = -(-self.max_model_len // self.block_size)
        self.cos_sin = rope_cos_sin(mc.head_dim, mc.rope_theta, mc.rope_scaling, self.max_model_len, self.device)
        self.num_blocks = config.num_blocks or self._auto_num_blocks()
        # one extra block at index num_blocks: scratch slots for padded (graph) rows
        shape = (self.num_blocks + 1, self.block_size, mc.num_kv_heads, mc.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=self.kv_dtype, device=self.device),
             torch.zeros(shape, dtype=self.kv_dtype, device=self.device))
            for _ in range(mc.num_layers)
        ]
        self.pad_slot = self.num_blocks * self.block_size
        # long uncached prompts: dense causal attention (cuDNN) beats the paged kernel on CUDA
        self.dense_prefill_min_tokens = config.dense_prefill_min_tokens if self.device.type == "cuda" else None
        self.sampler = Sampler(self.device, config.seed)
        self._generators: dict[str, torch.Generator] = {}
        self.last_path = ""  # how the last step ran: decode_graph, prefill_graph, mixed_graph or eager
        self.path_steps: dict[str, int] = {}  # steps run on each path (diagnostics, benchmarks)
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None
        self.mixed_graphs: MixedGraphs | None = None
        if self.device.type == "cuda":
            self._warm_up()
        if config.cuda_graphs and self.device.type == "cuda" and self.ops.name == "triton":
            max_bs = min(config.cuda_graph_max_batch or config.max_num_seqs, config.max_num_seqs)
            self.graphs = DecodeGraphs(self, max_bs)
            max_t = min(config.prefill_graph_max_tokens, config.max_num_batched_tokens)
            self.prefill_graphs = PrefillGraphs(self, max_t, min(config.prefill_graph_max_seqs, config.max_num_seqs))
            mixed_t = min(config.mixed_graph_max_tokens, config.max_num_batched_tokens)
            if mixed_t > 0 and max_bs > 1:
                self.mixed_graphs = MixedGraphs(self, max_bs, mixed_t, min(config.mixed_graph_max_prefills,
                                                                            config.max_num_seqs))
            capture_graphs(*(g for g in (self.graphs, self.prefill_graphs, self.mixed_graphs) if g is not None))
        if self.dense_prefill_min_tokens is not None:
            self._warm_dense_attention()

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
            slot_mapping=torch.full((n,), self.pad_slot, dtype=torch.int64, device=dev),
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
        self.model.compute_logits(hidden[-1:], residual[-1:])
        torch.cuda.synchronize(dev)

    def _warm_dense_attention(self) -> None:
        """Load the dense attention library (cuDNN) now: its first call costs about a second."""
        from workers.engine.attention import dense_causal_attention

        mc = self.model_config
        n = self.dense_prefill_min_tokens or 1
        q = torch.randn(n, mc.num_heads, mc.head_dim, dtype=self.dtype, device=self.device)
        k = torch.randn(n, mc.num_kv_heads, mc.head_dim, dtype=self.dtype, device=self.device)
        dense_causal_attention(q, k, k, mc.head_dim**-0.5)
        torch.cuda.synchronize(self.device)

    # ---- loading and sizing -------------------------------------------------------------
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
        mc = self.model_config
        return 2 * mc.num_layers * self.block_size * mc.num_kv_heads * mc.head_dim * self.kv_dtype.itemsize

    def _auto_num_blocks(self) -> int:
        c = self.config
        if self.device.type != "cuda":
            return max(c.cpu_kv_cache_tokens // self.block_size, 1)
        mc = self.model_config
        free, total = torch.cuda.mem_get_info(self.device)
        used_by_others_and_us = total - free
        # activations of the largest step plus logits, with margin (measured peaks are below this)
        t = c.max_num_batched_tokens
        act = t * (mc.hidden_size * 12 + mc.intermediate_size * 6 + (mc.q_size + 2 * mc.kv_size) * 4)
        act += c.max_num_seqs * mc.vocab_size * 4 * 4 + (1 << 30)
        budget = total * c.gpu_memory_utilization - used_by_others_and_us - act
        n = int(budget // self.kv_bytes_per_block())
        if n < self.max_blocks_per_seq // 4:
            raise RuntimeError(
                f"only {max(n, 0)} KV blocks fit in GPU memory; lower max_num_batched_tokens or "
                "raise gpu_memory_utilization"
            )
        return n

    # ---- one step -------------------------------------------------------------------------
    def host_inputs(self, out: SchedulerOutput) -> tuple[np.ndarray, ...]:
        """The step's varlen batch on the host.

        Returns (input_ids [T], positions [T], slots [T], block tables [B, W], query_start_loc [B + 1],
        seq_lens [B], logit rows): the rows are the flattened indices of the last token of each
        sequence that samples.
        """
        entries = out.scheduled
        n_new = np.fromiter((e.num_new_tokens for e in entries), dtype=np.int64, count=len(entries))
        start = np.fromiter((e.num_computed_tokens for e in entries), dtype=np.int64, count=len(entries))
        seq_lens = start + n_new
        cu = np.concatenate(([0], np.cumsum(n_new)))
        total = int(cu[-1])
        ids: list[int] = []
        for e in entries:
            s = e.num_computed_tokens
            ids.extend(e.request.token_ids[s : s + e.num_new_tokens])
        tok_row = np.repeat(np.arange(len(entries)), n_new)
        positions = np.arange(total, dtype=np.int64) - cu[:-1][tok_row] + start[tok_row]
        width = int(-(-seq_lens.max() // self.block_size))
        tables = np.zeros((len(entries), width), dtype=np.int32)
        for i, e in enumerate(entries):
            b = e.request.block_ids[:width]
            tables[i, : len(b)] = b
        slots = tables[tok_row, positions // self.block_size].astype(np.int64) * self.block_size + (
            positions % self.block_size
        )
        sample_rows = np.array([i for i, e in enumerate(entries) if e.samples], dtype=np.int64)
        logit_rows = cu[1:][sample_rows] - 1
        return (np.asarray(ids, dtype=np.int64), positions, slots, tables, cu.astype(np.int32),
                seq_lens.astype(np.int32), logit_rows)

    def prepare(self, out: SchedulerOutput) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, np.ndarray]:
        """Flatten the step's tokens into one varlen batch. Returns (input_ids, positions, meta, logit rows)."""
        ids, positions, slots, tables, cu, seq_lens, logit_rows = self.host_inputs(out)
        nd = out.num_decodes
        n_seq = len(out.scheduled)
        dev = self.device
        input_ids = torch.from_numpy(ids).to(dev, non_blocking=True)
        pos_t = torch.from_numpy(positions).to(dev, non_blocking=True)
        tables_t = torch.from_numpy(tables).to(dev, non_blocking=True)
        seq_t = torch.from_numpy(seq_lens).to(dev, non_blocking=True)
        np_ = n_seq - nd
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev, non_blocking=True),
            num_decodes=nd,
            num_decode_tokens=nd,
            decode_block_tables=tables_t[:nd] if nd else None,
            decode_seq_lens=seq_t[:nd] if nd else None,
            prefill_block_tables=tables_t[nd:] if np_ else None,
            prefill_query_start_loc=(
                torch.from_numpy(cu[nd:] - cu[nd]).to(dev, non_blocking=True) if np_ else None
            ),
            prefill_seq_lens=seq_t[nd:] if np_ else None,
            prefill_max_query_len=int((cu[nd + 1 :] - cu[nd:-1]).max()) if np_ else 0,
            prefill_dense=(
                self.dense_prefill_min_tokens is not None and n_seq == 1 and nd == 0
                and out.scheduled[0].num_computed_tokens == 0 and len(ids) >= self.dense_prefill_min_tokens
            ),
        )
        return input_ids, pos_t, meta, logit_rows

    def sampling_batch(self, reqs: list[Request]) -> SamplingBatch:
        if all(r.sampling.temperature == 0.0 for r in reqs):
            return SamplingBatch(True, None, None, None, None, [])
        dev = self.device
        temps = [r.sampling.temperature or 1.0 for r in reqs]
        greedy = [r.sampling.temperature == 0.0 for r in reqs]
        v = self.model_config.vocab_size
        top_k = [r.sampling.top_k if r.sampling.top_k else v for r in reqs]
        top_p = [r.sampling.top_p for r in reqs]
        gens: list[torch.Generator | None] = []
        for r in reqs:
            g = None
            if r.sampling.seed is not None and r.sampling.temperature > 0:
                g = self._generators.get(r.request_id)
                if g is None:
                    g = torch.Generator(device=dev).manual_seed(r.sampling.seed)
                    self._generators[r.request_id] = g
            gens.append(g)
        return SamplingBatch(
            all_greedy=False,
            temperature=torch.tensor(temps, dtype=torch.float32).to(dev, non_blocking=True),
            greedy_mask=torch.tensor(greedy, dtype=torch.bool).to(dev, non_blocking=True),
            top_k=torch.tensor(top_k, dtype=torch.int64).to(dev, non_blocking=True) if any(k < v for k in top_k) else None,
            top_p=torch.tensor(top_p, dtype=torch.float32).to(dev, non_blocking=True) if any(p < 1.0 for p in top_p) else None,
            generators=gens,
        )

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
        for graphs in (self.graphs, self.prefill_graphs, self.mixed_graphs):
            if graphs is not None:
                graphs.close()
        self.graphs = self.prefill_graphs = self.mixed_graphs = None
        self.kv_caches = []
        self.cos_sin = None  # type: ignore[assignment]
        self.model = None  # type: ignore[assignment]
        self._generators.clear()
        self.sampler = None  # type: ignore[assignment]
        gc.collect()  # the graph sets and the model's modules can sit in reference cycles
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # nothing in flight still reads the memory
            torch.cuda.empty_cache()

    def release(self, request_id: str) -> None:
        """Forget per-request state (its RNG) once it has finished."""
        self._generators.pop(request_id, None)

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
        if prev is None:
            return None
        dst = [i for i, e in enumerate(out.scheduled[: out.num_decodes]) if e.request.pending_row is not None]
        if not dst:
            return None
        src = [out.scheduled[i].request.pending_row for i in dst]
        return PendingInputs(prev.device_tokens, dst, src)

    def fill_pending(self, input_ids: torch.Tensor, pending: PendingInputs | None) -> None:
        """input_ids[dst] = previous step's tokens[src], on the device (decodes are the first rows)."""
        if pending is None:
            return
        idx = torch.tensor((pending.dst, pending.src), dtype=torch.int64).to(self.device, non_blocking=True)
        input_ids.index_copy_(0, idx[0], pending.tokens.index_select(0, idx[1]))  # one copy to the device

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, prev: SampledTokens | None = None) -> SampledTokens:
        """Launch the step; return its sampled tokens (one per entry that samples, in order).

        Nothing here waits for the device: `SampledTokens.tolist()` does. Decode inputs still
        pending on `prev` (async scheduling) are read from its tokens on the device. On CUDA the
        step's work is bracketed by two timing events: `SampledTokens.device_seconds()`.
        """
        if self.device.type != "cuda":
            return self._execute(out, prev)
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        sampled = self._execute(out, prev)
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        sampled.timing = (start, end)
        return sampled

    def _execute(self, out: SchedulerOutput, prev: SampledTokens | None) -> SampledTokens:
        try:
            return self._run_step(out, prev)
        finally:
            self.path_steps[self.last_path] = self.path_steps.get(self.last_path, 0) + 1

    def _run_step(self, out: SchedulerOutput, prev: SampledTokens | None) -> SampledTokens:
        sampling_reqs = [e.request for e in out.scheduled if e.samples]
        n_seq = len(out.scheduled)
        pending = self.pending_inputs(out, prev)
        plan = self._prompt_logprob_plan(out)
        prompt: PromptLogprobs | None = None
        if self.graphs is not None and out.num_decodes == n_seq and self.graphs.fits(n_seq):
            self.last_path = "decode_graph"
            logits = self.graphs.run(out, pending)
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
            self.fill_pending(input_ids, pending)
            hidden, residual = self.model(input_ids, positions, self.cos_sin, self.kv_caches, meta)
            if plan:
                prompt = self._prompt_logprobs(hidden, residual, plan)
            if len(logit_rows) == 0:
                return SampledTokens(None, prompt=prompt) if prompt else SampledTokens.empty()
            rows = torch.from_numpy(logit_rows).to(self.device, non_blocking=True)
            logits = self.model.compute_logits(hidden[rows], residual[rows])
        if not sampling_reqs:
            return SampledTokens(None, prompt=prompt) if prompt else SampledTokens.empty()
        tokens = self.sampler(logits, self.sampling_batch(sampling_reqs))
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

    def decode_num_splits(self, batch: int) -> int:
        """Flash-decoding splits for a graph-captured batch: enough programs to fill the GPU."""
        sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        progs = batch * self.model_config.num_kv_heads
        want = math.ceil(2 * sms / progs)
        return int(max(1, min(want, 32, self.max_blocks_per_seq)))
