"""A scheduled step as the device sees it: the flattened varlen batch on the host, its tensors and
attention metadata on the device, and decode inputs still pending on the device (async scheduling).

The model runner and the CUDA graphs both build their inputs here: the graphs copy the same host
batch into their static buffers, padded to a bucket.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from workers.engine.attention import AttentionMetadata

if TYPE_CHECKING:
    from workers.engine.scheduler import SchedulerOutput


@dataclass(frozen=True)
class CacheLayout:
    """Where a step's tokens can go: the paged KV cache's shape and its scratch block."""

    device: torch.device
    block_size: int  # tokens per block
    num_blocks: int  # real blocks; block `num_blocks` is scratch (padded graph rows write there)
    max_blocks_per_seq: int  # block-table width of the longest sequence

    @property
    def pad_slot(self) -> int:
        """The scratch block's first slot: where padded rows write their K/V."""
        return self.num_blocks * self.block_size


class HostBatch(NamedTuple):
    """A step's varlen batch on the host (decodes first, then the prompt chunks)."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64: the cache slot of each token
    block_tables: np.ndarray  # [B, W] int32, W the widest sequence's blocks
    query_start_loc: np.ndarray  # [B + 1] int32
    seq_lens: np.ndarray  # [B] int32: context including the new tokens
    logit_rows: np.ndarray  # flattened index of the last token of each sequence that samples


def host_batch(out: SchedulerOutput, block_size: int) -> HostBatch:
    """Flatten the scheduled step on the host."""
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
    width = int(-(-seq_lens.max() // block_size))
    tables = np.zeros((len(entries), width), dtype=np.int32)
    for i, e in enumerate(entries):
        b = e.request.block_ids[:width]
        tables[i, : len(b)] = b
    slots = tables[tok_row, positions // block_size].astype(np.int64) * block_size + (positions % block_size)
    sample_rows = np.array([i for i, e in enumerate(entries) if e.samples], dtype=np.int64)
    logit_rows = cu[1:][sample_rows] - 1
    return HostBatch(np.asarray(ids, dtype=np.int64), positions, slots, tables, cu.astype(np.int32),
                     seq_lens.astype(np.int32), logit_rows)


def device_batch(out: SchedulerOutput, batch: HostBatch, device: torch.device,
                 dense_prefill_min_tokens: int | None) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """The eager step's (input_ids, positions, attention metadata) on the device, copies in flight."""
    ids, positions, slots, tables, cu, seq_lens, _rows = batch
    nd = out.num_decodes
    n_seq = len(out.scheduled)
    np_ = n_seq - nd

    def dev(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(device, non_blocking=True)

    tables_t, seq_t = dev(tables), dev(seq_lens)
    meta = AttentionMetadata(
        slot_mapping=dev(slots),
        num_decodes=nd,
        num_decode_tokens=nd,
        decode_block_tables=tables_t[:nd] if nd else None,
        decode_seq_lens=seq_t[:nd] if nd else None,
        prefill_block_tables=tables_t[nd:] if np_ else None,
        prefill_query_start_loc=dev(cu[nd:] - cu[nd]) if np_ else None,
        prefill_seq_lens=seq_t[nd:] if np_ else None,
        prefill_max_query_len=int((cu[nd + 1 :] - cu[nd:-1]).max()) if np_ else 0,
        prefill_dense=(
            dense_prefill_min_tokens is not None and n_seq == 1 and nd == 0
            and out.scheduled[0].num_computed_tokens == 0 and len(ids) >= dense_prefill_min_tokens
        ),
    )
    return dev(ids), dev(positions), meta


@dataclass
class PendingInputs:
    """Decode rows whose input token is still on the device: input_ids[dst[i]] = tokens[src[i]]."""

    tokens: torch.Tensor  # [N] int64: the previous step's sampled tokens, on the device
    dst: list[int]  # token rows of this step (decodes come first: row = entry index)
    src: list[int]  # rows of `tokens`


def pending_inputs(out: SchedulerOutput, prev_tokens: torch.Tensor | None) -> PendingInputs | None:
    """Decode inputs that are tokens the previous step sampled (`prev_tokens`, on the device) but
    the host has not read yet."""
    if prev_tokens is None:
        return None
    dst = [i for i, e in enumerate(out.scheduled[: out.num_decodes]) if e.request.pending_row is not None]
    if not dst:
        return None
    src = [out.scheduled[i].request.pending_row for i in dst]
    return PendingInputs(prev_tokens, dst, src)  # type: ignore[arg-type]


def fill_pending(input_ids: torch.Tensor, pending: PendingInputs | None) -> None:
    """input_ids[dst] = previous step's tokens[src], on the device (decodes are the first rows)."""
    if pending is None:
        return
    idx = torch.tensor((pending.dst, pending.src), dtype=torch.int64).to(input_ids.device, non_blocking=True)
    input_ids.index_copy_(0, idx[0], pending.tokens.index_select(0, idx[1]))  # one copy to the device


_NP = {torch.int64: np.int64, torch.int32: np.int32}


class PackedInputs:
    """A graph's static inputs as views of one device buffer, staged on the host in one buffer of the
    same layout and sent by one copy: one host-to-device copy a step instead of one per input (the
    prefill graphs made seven from pageable memory, each a synchronous staging by the driver).

    Each step stages into a fresh buffer from torch's caching pinned allocator (on CUDA), which hands
    a block out again only after the copy that read it has run: safe while the step before is still
    queued (async scheduling). Fields are laid out in the order given, each on a 16-byte boundary;
    `end(name, rows)` is where a copy may stop (the fields after it keep their device values)."""

    ALIGN = 16

    def __init__(self, fields: list[tuple[str, torch.dtype, tuple[int, ...]]], device: torch.device) -> None:
        self._at: dict[str, tuple[int, int, torch.dtype, tuple[int, ...]]] = {}  # name -> (offset, bytes, dtype, shape)
        off = 0
        for name, dtype, shape in fields:
            size = int(np.prod(shape)) * dtype.itemsize
            self._at[name] = (off, size, dtype, shape)
            off += -(-size // self.ALIGN) * self.ALIGN
        self.nbytes = off
        self.buffer = torch.zeros(off, dtype=torch.uint8, device=device)
        self._pin = self.buffer.device.type == "cuda"
        self._host: torch.Tensor | None = None

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self._at)

    def view(self, name: str) -> torch.Tensor:
        """The field's static tensor: a view of the device buffer (what a graph captures)."""
        off, size, dtype, shape = self._at[name]
        return self.buffer[off : off + size].view(dtype).view(shape)

    def stage(self) -> dict[str, np.ndarray]:
        """A new host staging buffer; the fields as numpy views of it, every byte unset until written."""
        self._host = torch.empty(self.nbytes, dtype=torch.uint8, pin_memory=self._pin)
        a = self._host.numpy()
        return {name: a[off : off + size].view(_NP[dtype]).reshape(shape)
                for name, (off, size, dtype, shape) in self._at.items()}

    def end(self, name: str, rows: int) -> int:
        """The byte just past the field's first `rows` rows."""
        off, size, _dtype, shape = self._at[name]
        return off + size // shape[0] * rows

    def send(self, upto: int | None = None) -> None:
        """Copy the staged bytes [0, upto) (all by default) to the device buffer, in stream order."""
        assert self._host is not None, "stage() first"
        n = self.nbytes if upto is None else upto
        self.buffer[:n].copy_(self._host[:n], non_blocking=True)
