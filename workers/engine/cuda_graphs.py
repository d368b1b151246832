"""CUDA graphs of the decode step, captured per batch-size bucket and replayed with padded inputs."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.engine.attention import AttentionMetadata

if TYPE_CHECKING:
    from workers.engine.model_runner import ModelRunner
    from workers.engine.scheduler import SchedulerOutput

log = logging.getLogger(__name__)


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


class DecodeGraphs:
    """One captured decode graph per bucket; prefill and mixed steps stay eager."""

    def __init__(self, runner: ModelRunner, max_bs: int) -> None:
        self.runner = runner
        self.max_bs = max_bs
        self.buckets = graph_buckets(max_bs)
        dev = runner.device
        self.input_ids = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((max_bs,), runner.pad_slot, dtype=torch.int64, device=dev)
        self.block_tables = torch.full(
            (max_bs, runner.max_blocks_per_seq), runner.num_blocks, dtype=torch.int32, device=dev
        )
        self.seq_lens = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}

    def fits(self, batch: int) -> bool:
        return 0 < batch <= self.max_bs

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
            decode_num_splits=self.runner.decode_num_splits(bs),
        )

    def _forward(self, bs: int) -> torch.Tensor:
        r = self.runner
        hidden, residual = r.model(self.input_ids[:bs], self.positions[:bs], r.cos_sin, r.kv_caches, self._meta(bs))
        return r.model.compute_logits(hidden, residual)

    @torch.inference_mode()
    def capture(self) -> None:
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.runner.device)
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for bs in reversed(self.buckets):
                for _ in range(2):  # compile kernels and settle allocations before capturing
                    self._forward(bs)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool, stream=stream):
                    logits = self._forward(bs)
                self.graphs[bs] = (g, logits)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        log.info("captured %d decode graphs (batch %s) in %.1f s", len(self.graphs), self.buckets,
                 time.perf_counter() - t0)

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Replay the smallest graph that holds the step's decodes; returns logits [B, V]."""
        r = self.runner
        entries = out.scheduled
        b = len(entries)
        bs = next(x for x in self.buckets if x >= b)
        bsz = r.block_size
        pos = np.fromiter((e.num_computed_tokens for e in entries), dtype=np.int64, count=b)
        ids = np.fromiter((e.request.token_ids[e.num_computed_tokens] for e in entries), dtype=np.int64, count=b)
        width = int(pos.max() // bsz + 1)
        tables = np.full((bs, width), r.num_blocks, dtype=np.int32)
        for i, e in enumerate(entries):
            blk = e.request.block_ids[:width]
            tables[i, : len(blk)] = blk
        slots = np.full(bs, r.pad_slot, dtype=np.int64)
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
        g, logits = self.graphs[bs]
        g.replay()
        return logits[:b]
