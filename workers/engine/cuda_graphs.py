"""CUDA graphs of steps, captured per bucket and replayed with padded inputs: decode steps, short
prefill or mixed steps, and the mixed steps of a loaded server. The runner hands them a
GraphContext (the model's forward over its KV cache, the logits, the cache layout); inputs come
from workers/engine/step_inputs.py, as the eager step's do."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.engine.attention import AttentionMetadata
from workers.engine.step_inputs import CacheLayout, PackedInputs, PendingInputs, fill_pending, host_batch

if TYPE_CHECKING:
    from workers.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GraphContext:
    """What the graphs capture and replay, handed over by the model runner: no graph reaches into it.

    forward(input_ids, positions, meta) -> (hidden, residual): the model over the KV cache;
    logits(hidden, residual): the final norm and lm_head, written to rows of one fp32 buffer every
    graph shares (one step runs at a time, and its sampler reads them in stream order before the next
    replay; a captured output per bucket stays allocated with its graph: the 71 decode buckets up to
    1024 held 15.98 GiB on the Llama-3.1-8B shape, outside the KV sizing); decode_splits(batch): the flash-decoding
    splits of a captured decode batch; prefill_splits(sequences, tokens, context bound): the
    prefill attention's key-range splits for those shapes.
    """

    layout: CacheLayout
    forward: Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], tuple[torch.Tensor, torch.Tensor]]
    logits: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    decode_splits: Callable[[int], int]
    prefill_splits: Callable[[int, int, int], int]


def _close_graphs(gs: DecodeGraphs | PrefillGraphs | MixedGraphs | DenseGraphs) -> None:
    """Reset every graph of a set (CUDAGraph.reset frees its captured allocations) and drop the
    set's device tensors and its context (the model's forward)."""
    for g, _logits in gs.graphs.values():
        g.reset()
    gs.graphs.clear()
    for name, value in list(vars(gs).items()):
        if isinstance(value, torch.Tensor):
            setattr(gs, name, None)
    gs.ctx = None  # type: ignore[assignment]


def graph_buckets(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 64, then every 16 up to max_bs (max_bs itself included)."""
    out = [b for b in (1, 2, 4, 8) if b <= max_bs]
    b = 16
    while b <= max_bs:
        out.append(b)
        b += 8 if b < 64 else 16
    if out[-1] != max_bs:
        out.append(max_bs)
    return out


_CAPTURE_STREAMS: dict[int, torch.cuda.Stream] = {}


def _capture_stream(device: int) -> torch.cuda.Stream:
    """One capture stream per device for every engine of the process: torch keeps a cuBLAS
    workspace (32 MiB on sm90) for each stream cuBLAS ran on, so a new stream per engine would
    leave one behind each time an engine closes."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device)
    return _CAPTURE_STREAMS[device]


def capture_graphs(*graph_sets: DecodeGraphs | PrefillGraphs | MixedGraphs | DenseGraphs) -> None:
    """Capture every graph set on one side stream, sharing one memory pool (largest graphs first)."""
    t0 = time.perf_counter()
    pool = torch.cuda.graph_pool_handle()
    stream = _capture_stream(torch.cuda.current_device())
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for gs in graph_sets:
            gs.capture(pool, stream)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    log.info("captured CUDA graphs %s in %.1f s", [sorted(gs.graphs) for gs in graph_sets],
             time.perf_counter() - t0)


class DecodeGraphs:
    """One captured decode graph per bucket; prefill and mixed steps stay eager."""

    def __init__(self, ctx: GraphContext, max_bs: int) -> None:
        self.ctx = ctx
        lay = ctx.layout
        self.max_bs = max_bs
        self.buckets = graph_buckets(max_bs)
        dev = lay.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), lay.pad_slot, dtype=torch.int64, device=dev)
        self.block_tables = torch.full(
            (max_bs, lay.max_blocks_per_seq), lay.num_blocks, dtype=torch.int32, device=dev
        )
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.max_bs

    def close(self) -> None:
        """Free the captured graphs (their memory pool goes with the last of them) and the static buffers."""
        _close_graphs(self)

    def _meta(self, bs: int) -> AttentionMetadata:
        return AttentionMetadata(
            slot_mapping=self.slot_mapping[:bs],
            num_decodes=bs,
            num_decode_tokens=bs,
            decode_block_tables=self.block_tables[:bs],
            decode_seq_lens=self.seq_lens[:bs],
            prefill_block_tables=None,
            prefill_query_start_loc=None,
            prefill_seq_lens=None,
            decode_num_splits=self.ctx.decode_splits(bs),
        )

    def _forward(self, bs: int) -> torch.Tensor:
        hidden, residual = self.ctx.forward(self.input_ids[:bs], self.positions[:bs], self._meta(bs))
        return self.ctx.logits(hidden, residual)

    @torch.inference_mode()
    def capture(self, pool: object, stream: torch.cuda.Stream) -> None:
        for bs in reversed(self.buckets):
            for _ in range(2):  # compile kernels and settle allocations before capturing
                self._forward(bs)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                logits = self._forward(bs)
            self.graphs[bs] = (g, logits)

    def run(self, out: SchedulerOutput, pending: PendingInputs | None = None) -> torch.Tensor:
        """Replay the smallest graph that holds the step's decodes; returns logits [B, V]."""
        lay = self.ctx.layout
        entries = out.scheduled
        b = len(entries)
        bs = next(x for x in self.buckets if x >= b)
        bsz = lay.block_size
        pos = np.fromiter((e.num_computed_tokens for e in entries), dtype=np.int64, count=b)
        ids = np.fromiter((e.request.token_ids[e.num_computed_tokens] for e in entries), dtype=np.int64, count=b)
        width = int(pos.max() // bsz + 1)
        tables = np.full((bs, width), lay.num_blocks, dtype=np.int32)
        for i, e in enumerate(entries):
            blk = e.request.block_ids[:width]
            tables[i, : len(blk)] = blk
        slots = np.full(bs, lay.pad_slot, dtype=np.int64)
        slots[:b] = tables[np.arange(b), pos // bsz].astype(np.int64) * bsz + pos % bsz
        seq = np.ones(bs, dtype=np.int32)
        seq[:b] = pos + 1
        ids_p = np.zeros(bs, dtype=np.int64)
        ids_p[:b] = ids
        pos_p = np.zeros(bs, dtype=np.int64)
        pos_p[:b] = pos
        self.input_ids[:bs].copy_(torch.from_numpy(ids_p), non_blocking=True)
        self.positions[:bs].copy_(torch.from_numpy(pos_p), non_blocking=True)
        self.slot_mapping[:bs].copy_(torch.from_numpy(slots), non_blocking=True)
        self.seq_lens[:bs].copy_(torch.from_numpy(seq), non_blocking=True)
        self.block_tables[:bs, :width].copy_(torch.from_numpy(tables), non_blocking=True)
        fill_pending(self.input_ids, pending)
        g, logits = self.graphs[bs]
        g.replay()
        return logits[:b]


def warm_up_spans(t: int, longest: int) -> list[int]:
    """Where each warm-up sequence of a t-token prefill graph ends: as few sequences as hold the tokens,
    none longer than `longest` (a block table's tokens; a longer one had the kernel read past its row,
    beyond the tensor with one sequence: an illegal address, max_num_seqs=1 with t > max_model_len)."""
    return [min(t, end) for end in range(longest, t + longest, longest)]


def token_buckets(max_tokens: int) -> list[int]:
    """Token rows of the prefill graphs: powers of two from 16 to 256, then every 128 up to
    max_tokens (itself included). A padded row costs a row of every GEMM: with power-of-two
    buckets a step of 528 tokens (a 512-token prompt and its choices' last blocks) replayed the
    1024-token graph, 24.7 ms against 12.8 for 512 on the H200 (bf16 Llama-3.1-8B shape,
    bench/bench_choices.py at ec1c5ad)."""
    out = []
    b = 16
    while b < max_tokens:
        out.append(b)
        b = b * 2 if b < 256 else b + 128
    out.append(max_tokens)
    return out


class PrefillGraphs:
    """Captured steps of up to `max_seqs` sequences and `max_tokens` tokens (prefills mixed with decodes).

    Short prefills are bound by the CPU launching ~300 kernels, not by the GPU; replaying a graph
    removes that. Every sequence goes through the varlen prefill kernel (a decode is a one-token
    prefill). Padded tokens write to the scratch slot; padded sequences have no tokens.
    """

    def __init__(self, ctx: GraphContext, max_tokens: int, max_seqs: int) -> None:
        self.ctx = ctx
        lay = ctx.layout
        self.max_seqs = max_seqs
        # no step holds more tokens than max_seqs sequences of the longest context
        self.buckets = token_buckets(min(max_tokens, max_seqs * lay.max_blocks_per_seq * lay.block_size))
        dev = lay.device
        t = self.buckets[-1]
        # the static inputs: views of one buffer (step_inputs.PackedInputs), the block tables last so
        # that one copy can stop after a step's rows; a step's inputs are staged in one pinned buffer and
        # sent in one copy (0.22-0.47 ms off TTFT 2048 cached + 128 on an H100 against seven pageable
        # copies, the load before 6143b4c)
        self.packed = PackedInputs([
            ("input_ids", torch.int64, (t,)), ("positions", torch.int64, (t,)),
            ("slot_mapping", torch.int64, (t,)), ("logit_rows", torch.int64, (max_seqs,)),
            ("query_start_loc", torch.int32, (max_seqs + 1,)), ("seq_lens", torch.int32, (max_seqs,)),
            ("block_tables", torch.int32, (max_seqs, lay.max_blocks_per_seq)),
        ], dev)
        for name in self.packed.names:
            setattr(self, name, self.packed.view(name))
        self.slot_mapping.fill_(lay.pad_slot)
        self.block_tables.fill_(lay.num_blocks)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}  # (t, splits)
        self.split_of: dict[int, int] = {}  # bucket -> split count of its worst-case graph
        self.last_splits = 0  # split count of the last replayed graph (diagnostics, tests)

    def fits(self, num_tokens: int, num_seqs: int) -> bool:
        return num_tokens <= self.buckets[-1] and num_seqs <= self.max_seqs

    def close(self) -> None:
        """Free the captured graphs and the static buffers."""
        _close_graphs(self)
        self.packed = None  # (its buffer is the static inputs' storage)

    def _splits(self, t: int, ctx_bound: int) -> int:
        """Prefill key-range splits the kernel picks for bucket t at contexts up to ctx_bound."""
        return self.ctx.prefill_splits(self.max_seqs, t, ctx_bound)

    def _forward(self, t: int, num_splits: int | None) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            num_decodes=0,
            num_decode_tokens=0,
            decode_block_tables=None,
            decode_seq_lens=None,
            prefill_block_tables=self.block_tables,
            prefill_query_start_loc=self.query_start_loc,
            prefill_seq_lens=self.seq_lens,
            prefill_max_query_len=t,
            prefill_num_splits=num_splits,
        )
        hidden, residual = self.ctx.forward(self.input_ids[:t], self.positions[:t], meta)
        rows = self.logit_rows
        return self.ctx.logits(hidden[rows], residual[rows])

    @torch.inference_mode()
    def capture(self, pool: object, stream: torch.cuda.Stream) -> None:
        """Per token bucket: a graph whose attention splits the key range as the worst-case
        context needs (a long cached prefix), and, where that splits, one that does not (a step
        whose contexts are short: its partials and their combination would be pure overhead)."""
        worst = self.ctx.layout.max_blocks_per_seq * self.ctx.layout.block_size
        for t in reversed(self.buckets):
            # warm-up inputs: as few sequences as hold every token (none longer than a block table
            # holds: past it the kernel would read beyond the table), written to the scratch block
            ends = warm_up_spans(t, worst)
            assert len(ends) <= self.max_seqs, (t, worst, self.max_seqs)  # buckets stop at max_seqs * worst
            n = len(ends)
            self.query_start_loc.fill_(t)
            self.query_start_loc[0] = 0
            self.query_start_loc[1 : n + 1] = torch.tensor(ends, dtype=torch.int32)
            self.seq_lens.zero_()
            self.seq_lens[:n] = torch.tensor([e - s for s, e in zip([0, *ends], ends)], dtype=torch.int32)
            self.positions.zero_()
            self.split_of[t] = self._splits(t, worst)
            for splits in sorted({self.split_of[t], 1}, reverse=True):  # the larger partials first
                for _ in range(2):
                    self._forward(t, splits)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    logits = self._forward(t, splits)
                self.graphs[(t, splits)] = (g, logits)

    def load(self, out: SchedulerOutput, pending: PendingInputs | None = None) -> tuple[int, int, int]:
        """Copy the step's inputs into the static buffers; returns (token bucket, rows that sample,
        the longest context)."""
        lay = self.ctx.layout
        input_ids, positions, slots, tables, qsl, seq_lens, logit_rows = host_batch(out, lay.block_size)
        t = next(x for x in self.buckets if x >= len(input_ids))
        self._load_packed(t, input_ids, positions, slots, tables, qsl, seq_lens, logit_rows)
        fill_pending(self.input_ids, pending)
        return t, len(logit_rows), int(seq_lens.max())

    def _load_packed(self, t: int, input_ids: np.ndarray, positions: np.ndarray, slots: np.ndarray,
                     tables: np.ndarray, qsl: np.ndarray, seq_lens: np.ndarray, logit_rows: np.ndarray) -> None:
        """load()'s inputs staged in one host buffer and sent in one copy: every byte sent is written
        (the staging buffer comes uninitialised); padded tokens get id and position 0 and the scratch
        slot, padded sequences no tokens (starts at n, length 0), and table columns past the step's
        widest row the out-of-range block id num_blocks."""
        pk = self.packed
        n, s, w = len(input_ids), len(seq_lens), tables.shape[1]
        v = pk.stage()
        v["input_ids"][:n] = input_ids
        v["input_ids"][n:] = 0  # (the graph of bucket t reads [:t]; past it too, so no byte sent is unset)
        v["positions"][:n] = positions
        v["positions"][n:] = 0
        v["slot_mapping"][:n] = slots
        v["slot_mapping"][n:] = self.ctx.layout.pad_slot
        v["logit_rows"][: len(logit_rows)] = logit_rows
        v["logit_rows"][len(logit_rows) :] = 0
        v["query_start_loc"][: s + 1] = qsl
        v["query_start_loc"][s + 1 :] = n
        v["seq_lens"][:s] = seq_lens
        v["seq_lens"][s:] = 0
        v["block_tables"][:s, :w] = tables
        v["block_tables"][:s, w:] = self.ctx.layout.num_blocks
        pk.send(pk.end("block_tables", s))  # the rows past the step's keep their device values

    def run(self, out: SchedulerOutput, pending: PendingInputs | None = None) -> torch.Tensor:
        """Replay the smallest graph that holds the step; returns logits of the sampling rows."""
        t, n_rows, longest = self.load(out, pending)
        splits = self.split_of[t]
        if splits > 1 and self._splits(t, longest) == 1:
            splits = 1
        self.last_splits = splits
        g, logits = self.graphs[(t, splits)]
        g.replay()
        return logits[:n_rows]


def dense_buckets(min_tokens: int, max_tokens: int, step: int = 128) -> list[int]:
    """Token rows of the dense prefill graphs: every `step` from the first multiple of it at or
    above min_tokens up to max_tokens (itself included); none when max_tokens < min_tokens."""
    if max_tokens < min_tokens:
        return []
    out = list(range(-(-min_tokens // step) * step, max_tokens, step))
    if not out or out[-1] != max_tokens:
        out.append(max_tokens)
    return out


class DenseGraphs:
    """Captured prefills of one uncached prompt of `min_tokens` to `max_tokens` tokens, attention
    dense and causal (cuDNN, as the eager step runs such a prompt) on the step's own q/k/v.

    The eager step launches ~500 kernels; on the H200 (FP8 Llama-3.1-8B shape, TTFT 2048) its
    first layers left the GPU idle 1.65 ms between kernels, and the whole prefill took 28.5-30.3 ms
    in some runs and 33.6-36.9 in others of the same call (the host's launch rate; a replayed graph
    does not depend on it). Rows past the prompt are padding: they come after every real row, so a
    causal mask keeps them out of the real rows' attention; their K/V go to the scratch slot and
    their logits are never read.
    """

    def __init__(self, ctx: GraphContext, min_tokens: int, max_tokens: int) -> None:
        self.ctx = ctx
        lay = ctx.layout
        self.min_tokens = min_tokens
        self.buckets = dense_buckets(min_tokens, max_tokens)
        dev = lay.device
        t = self.buckets[-1] if self.buckets else 0
        self.input_ids = torch.zeros(t, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(t, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((t,), lay.pad_slot, dtype=torch.int64, device=dev)
        self.logit_row = torch.zeros(1, dtype=torch.int64, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, out: SchedulerOutput) -> bool:
        """One prompt from its first token, nothing else in the step, within the buckets."""
        if len(out.scheduled) != 1 or out.num_decodes or not self.buckets:
            return False
        e = out.scheduled[0]
        return e.num_computed_tokens == 0 and self.min_tokens <= out.num_batched_tokens <= self.buckets[-1]

    def close(self) -> None:
        """Free the captured graphs and the static buffers."""
        _close_graphs(self)

    def _forward(self, t: int) -> torch.Tensor:
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[:t],
            num_decodes=0,
            num_decode_tokens=0,
            decode_block_tables=None,
            decode_seq_lens=None,
            prefill_block_tables=None,
            prefill_query_start_loc=None,
            prefill_seq_lens=None,
            prefill_max_query_len=t,
            prefill_dense=True,
        )
        hidden, residual = self.ctx.forward(self.input_ids[:t], self.positions[:t], meta)
        return self.ctx.logits(hidden[self.logit_row], residual[self.logit_row])

    @torch.inference_mode()
    def capture(self, pool: object, stream: torch.cuda.Stream) -> None:
        """Per token bucket, largest first: two warm-up forwards (cuDNN builds its plan for the
        shape), then the capture."""
        for t in reversed(self.buckets):
            self.positions[:t].copy_(torch.arange(t, device=self.positions.device))
            self.logit_row.fill_(t - 1)
            for _ in range(2):
                self._forward(t)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool, stream=stream):
                logits = self._forward(t)
            self.graphs[t] = (g, logits)

    def load(self, out: SchedulerOutput, pending: PendingInputs | None = None) -> tuple[int, int]:
        """Copy the step's inputs into the static buffers, padded to the smallest bucket that holds
        them; returns (bucket, rows that sample: 1, or 0 for a prompt's first chunk)."""
        lay = self.ctx.layout
        input_ids, positions, slots, _tables, _qsl, _seq_lens, logit_rows = host_batch(out, lay.block_size)
        n = len(input_ids)
        t = next(x for x in self.buckets if x >= n)
        host = np.zeros((3, t), dtype=np.int64)  # padded rows: token 0 at position 0 (inside the RoPE table)
        host[0, :n] = input_ids
        host[1, :n] = positions
        host[2, :] = lay.pad_slot
        host[2, :n] = slots
        src = torch.from_numpy(host)
        if self.input_ids.is_cuda:
            src = src.pin_memory()  # a pageable source can hold the host until the copy is staged
        self.input_ids[:t].copy_(src[0], non_blocking=True)
        fill_pending(self.input_ids, pending)
        self.positions[:t].copy_(src[1], non_blocking=True)
        self.slot_mapping[:t].copy_(src[2], non_blocking=True)
        self.logit_row.fill_(n - 1)
        return t, len(logit_rows)

    def run(self, out: SchedulerOutput, pending: PendingInputs | None = None) -> torch.Tensor:
        """Replay the smallest graph that holds the prompt; returns the logits of its last token
        ([1, V]; [0, V] for a prompt's first chunk, which does not sample)."""
        t, rows = self.load(out, pending)
        g, logits = self.graphs[t]
        g.replay()
        return logits[:rows]


def mixed_decode_buckets(max_decodes: int) -> list[int]:
    """Decode rows of the mixed graphs: 16, 32, 64, then 1.5x and 2x each power of two (96, 128,
    192, 256, 384, ...) up to max_decodes (itself included). Coarser than the decode graphs'
    buckets: a padded decode row costs one row of each GEMM and a one-block attention read."""
    out, p = [], 16
    while p < max_decodes:
        out.append(p)
        if p >= 64 and p * 3 // 2 < max_decodes:
            out.append(p * 3 // 2)
        p *= 2
    out.append(max_decodes)
    return out


def mixed_token_buckets(max_tokens: int) -> list[int]:
    """Prompt-token rows of the mixed graphs: 64, 128, 256, then every 128 up to max_tokens
    (itself included). A padded row costs a row of every GEMM, so above 256 the buckets are
    linear: on the H200 power-of-two buckets up to 2048 made 1024-1536-token steps 55 ms
    against 36 ms eager (bench/results/2026-12-02-load-h200.md)."""
    out, b = [], 64
    while b < max_tokens:
        out.append(b)
        b = b * 2 if b < 256 else b + 128
    out.append(max_tokens)
    return out


class MixedGraphs:
    """Captured mixed steps: many decodes beside a few prompt chunks, as a server runs under load.

    A graph per (decode bucket, prompt-token bucket, prefill splits) holds `db` decode rows, which
    go through the decode kernel (one query per sequence, the grouped heads in one tile), then `t`
    prompt-token rows of at most `max_prefills` chunks through the varlen prefill kernel. Padded
    decode rows attend to the scratch block and write to its slot; padded prompt rows belong to no
    chunk. The graph ends at the sampled rows' hidden states: the final norm and lm_head run after
    it, eagerly (three kernels), so that no graph keeps a [rows, vocab] logits buffer of its own.

    Without graphs such a step launches ~500 kernels from the host (~15 ms on the H200 beside ~60
    decodes: bench/results/2026-12-01-load-h200-session2.md), longer than its GPU work unless the
    chunk is large.
    """

    def __init__(self, ctx: GraphContext, max_decodes: int, max_tokens: int, max_prefills: int) -> None:
        self.ctx = ctx
        lay = ctx.layout
        self.decode_buckets = mixed_decode_buckets(max_decodes)
        self.token_buckets = mixed_token_buckets(max_tokens)
        self.max_prefills = max_prefills
        dev = lay.device
        d_max, t_max = self.decode_buckets[-1], self.token_buckets[-1]
        rows = d_max + t_max
        self.input_ids = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(rows, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((rows,), lay.pad_slot, dtype=torch.int64, device=dev)
        w = lay.max_blocks_per_seq
        self.decode_tables = torch.full((d_max, w), lay.num_blocks, dtype=torch.int32, device=dev)
        self.decode_seq_lens = torch.ones(d_max, dtype=torch.int32, device=dev)
        self.prefill_tables = torch.full((max_prefills, w), lay.num_blocks, dtype=torch.int32, device=dev)
        self.query_start_loc = torch.zeros(max_prefills + 1, dtype=torch.int32, device=dev)
        self.prefill_seq_lens = torch.zeros(max_prefills, dtype=torch.int32, device=dev)
        self.sample_rows = torch.zeros(d_max + max_prefills, dtype=torch.int64, device=dev)
        # (decode bucket, token bucket, prefill splits) -> (graph, (hidden, residual) of the sampled rows)
        self.graphs: dict[tuple[int, int, int], tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, torch.Tensor]]] = {}
        self.split_of: dict[int, int] = {}  # token bucket -> prefill splits of its worst-case graph
        self.decode_splits: dict[int, int | None] = {}  # decode bucket -> its flash-decoding splits

    def fits(self, out: SchedulerOutput) -> bool:
        nd = out.num_decodes
        prefills = len(out.scheduled) - nd
        return (0 < nd <= self.decode_buckets[-1] and 0 < prefills <= self.max_prefills
                and out.num_batched_tokens - nd <= self.token_buckets[-1])

    def close(self) -> None:
        """Free the captured graphs and the static buffers."""
        _close_graphs(self)

    def _prefill_splits(self, t: int, ctx_bound: int) -> int:
        return self.ctx.prefill_splits(self.max_prefills, t, ctx_bound)

    def forward(self, db: int, t: int, prefill_splits: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The captured work of graph (db, t): the model over the static inputs' first db + t rows,
        then the sampled rows' (hidden, residual)."""
        meta = AttentionMetadata(
            slot_mapping=self.slot_mapping[: db + t],
            num_decodes=db,
            num_decode_tokens=db,
            decode_block_tables=self.decode_tables[:db],
            decode_seq_lens=self.decode_seq_lens[:db],
            prefill_block_tables=self.prefill_tables,
            prefill_query_start_loc=self.query_start_loc,
            prefill_seq_lens=self.prefill_seq_lens,
            prefill_max_query_len=t,
            decode_num_splits=self.decode_splits.get(db),
            prefill_num_splits=prefill_splits,
        )
        hidden, residual = self.ctx.forward(self.input_ids[: db + t], self.positions[: db + t], meta)
        rows = self.sample_rows[: db + self.max_prefills]
        return hidden[rows], residual[rows]

    @torch.inference_mode()
    def capture(self, pool: object, stream: torch.cuda.Stream) -> None:
        """Per (decode bucket, token bucket): a graph whose prefill attention splits the key range
        as the worst-case context needs, and, where that splits, one that does not."""
        lay = self.ctx.layout
        worst = lay.max_blocks_per_seq * lay.block_size
        for db in self.decode_buckets:
            self.decode_splits[db] = self.ctx.decode_splits(db)
        for t in reversed(self.token_buckets):
            self.split_of[t] = self._prefill_splits(t, worst)
        for db in reversed(self.decode_buckets):
            for t in reversed(self.token_buckets):
                # warm-up inputs: scratch decodes, then one chunk holding every prompt row
                self.query_start_loc.fill_(t)
                self.query_start_loc[0] = 0
                self.prefill_seq_lens.zero_()
                self.prefill_seq_lens[0] = t
                for splits in sorted({self.split_of[t], 1}, reverse=True):
                    for _ in range(2):
                        self.forward(db, t, splits)
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g, pool=pool, stream=stream):
                        outs = self.forward(db, t, splits)
                    self.graphs[(db, t, splits)] = (g, outs)

    def load(self, out: SchedulerOutput, pending: PendingInputs | None = None) -> tuple[int, int, int, int]:
        """Write the step into the static inputs in the graphs' layout: returns (decode bucket,
        token bucket, prefill splits for its contexts, sampled rows)."""
        lay = self.ctx.layout
        ids, positions, slots, tables, cu, seq_lens, logit_rows = host_batch(out, lay.block_size)
        nd = out.num_decodes
        n_p = len(ids) - nd  # prompt rows
        s_p = len(seq_lens) - nd  # prompt chunks
        db = next(x for x in self.decode_buckets if x >= nd)
        t = next(x for x in self.token_buckets if x >= n_p)
        rows = db + t

        def padded(src: np.ndarray, fill: int) -> torch.Tensor:
            a = np.full(rows, fill, dtype=np.int64)
            a[:nd] = src[:nd]
            a[db : db + n_p] = src[nd:]
            return torch.from_numpy(a)

        self.input_ids[:rows].copy_(padded(ids, 0), non_blocking=True)
        fill_pending(self.input_ids, pending)  # decodes are the first rows in both layouts
        self.positions[:rows].copy_(padded(positions, 0), non_blocking=True)
        self.slot_mapping[:rows].copy_(padded(slots, lay.pad_slot), non_blocking=True)
        w = tables.shape[1]
        dt = np.full((db, w), lay.num_blocks, dtype=np.int32)
        dt[:nd] = tables[:nd]
        self.decode_tables[:db, :w].copy_(torch.from_numpy(dt), non_blocking=True)
        ds = np.ones(db, dtype=np.int32)
        ds[:nd] = seq_lens[:nd]
        self.decode_seq_lens[:db].copy_(torch.from_numpy(ds), non_blocking=True)
        self.prefill_tables[:s_p, :w].copy_(torch.from_numpy(np.ascontiguousarray(tables[nd:])), non_blocking=True)
        q = np.full(self.max_prefills + 1, n_p, dtype=np.int32)
        q[: s_p + 1] = cu[nd:] - cu[nd]
        self.query_start_loc.copy_(torch.from_numpy(q), non_blocking=True)
        sl = np.zeros(self.max_prefills, dtype=np.int32)
        sl[:s_p] = seq_lens[nd:]
        self.prefill_seq_lens.copy_(torch.from_numpy(sl), non_blocking=True)
        # a sampled row's place in the graph's layout: decode rows stay, prompt rows move by db - nd
        sr = np.zeros(db + self.max_prefills, dtype=np.int64)
        sr[: len(logit_rows)] = np.where(logit_rows < nd, logit_rows, logit_rows + (db - nd))
        self.sample_rows[: len(sr)].copy_(torch.from_numpy(sr), non_blocking=True)
        splits = self.split_of.get(t, 1)
        if splits > 1 and s_p and self._prefill_splits(t, int(seq_lens[nd:].max())) == 1:
            splits = 1
        return db, t, splits, len(logit_rows)

    def run(self, out: SchedulerOutput, pending: PendingInputs | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Replay the smallest graph that holds the step; returns the sampled rows' (hidden, residual)."""
        db, t, splits, n = self.load(out, pending)
        g, (hidden, residual) = self.graphs[(db, t, splits)]
        g.replay()
        return hidden[:n], residual[:n]
