"""One host-to-device copy of a graph's static inputs (step_inputs.PackedInputs), and what the prefill
graphs' load through it leaves in their static buffers, on the CPU."""

from __future__ import annotations

import numpy as np
import torch

from schemas.sampling import SamplingParams
from workers.engine.cuda_graphs import GraphContext, PrefillGraphs
from workers.engine.scheduler import ScheduledRequest, SchedulerOutput
from workers.engine.sequence import Request, RequestTimes
from workers.engine.step_inputs import CacheLayout, PackedInputs

CPU = torch.device("cpu")


def test_packed_inputs_layout_views_and_partial_send():
    """Fields on 16-byte boundaries in the order given, static views of one buffer with their dtypes and
    shapes; a send up to end(field, rows) copies the fields before it and that many rows, nothing after."""
    pk = PackedInputs([("a", torch.int64, (5,)), ("b", torch.int32, (3,)), ("t", torch.int32, (4, 6))], CPU)
    a, b, t = pk.view("a"), pk.view("b"), pk.view("t")
    assert (a.dtype, a.shape, b.dtype, b.shape, t.dtype, t.shape) == (
        torch.int64, (5,), torch.int32, (3,), torch.int32, (4, 6))
    assert pk.nbytes == 48 + 16 + 96 and a.data_ptr() == pk.buffer.data_ptr()
    assert b.data_ptr() - a.data_ptr() == 48 and t.data_ptr() - a.data_ptr() == 64
    t.fill_(-7)
    v = pk.stage()
    v["a"][:] = [1, 2, 3, 4, 2**40]
    v["b"][:] = [-1, 0, 9]
    v["t"][:] = np.arange(24, dtype=np.int32).reshape(4, 6)
    pk.send(pk.end("t", 2))
    assert a.tolist() == [1, 2, 3, 4, 2**40] and b.tolist() == [-1, 0, 9]
    assert t[:2].flatten().tolist() == list(range(12)) and (t[2:] == -7).all()  # rows past the send kept
    v = pk.stage()  # a fresh staging buffer: every field sent must be written again
    v["a"][:] = 0
    v["b"][:] = 5
    v["t"][:] = 100 + np.arange(24, dtype=np.int32).reshape(4, 6)
    pk.send()
    assert (a == 0).all() and (b == 5).all() and (t == 100 + torch.arange(24, dtype=torch.int32).view(4, 6)).all()


def _ctx(layout: CacheLayout) -> GraphContext:
    def unused(*_a):
        raise AssertionError("load() runs no model")

    return GraphContext(layout=layout, forward=unused, logits=unused, decode_splits=unused, prefill_splits=unused)


def _step(specs: list[tuple[int, int, int]], block_size: int) -> tuple[SchedulerOutput, dict]:
    """(tokens known, computed before the step, computed now) per sequence, token i of a prompt being
    3 + i and blocks numbered backwards from 200; returns the step and, computed here from the specs
    alone, what a replayed graph must read: each token's id, position and slot, each sequence's start,
    context length and block-table row, and the flat row of each sampling sequence's last token."""
    out = SchedulerOutput()
    want = {"input_ids": [], "positions": [], "slot_mapping": [], "query_start_loc": [0], "seq_lens": [],
            "block_tables": [], "logit_rows": []}
    nxt = 200
    for i, (known, done, new) in enumerate(specs):
        req = Request(f"r{i}", list(range(3, 3 + known)), known, SamplingParams(max_tokens=1), 0, i, RequestTimes(0.0))
        nb = -(-(done + new) // block_size)
        blocks = list(range(nxt, nxt - nb, -1))
        req.block_ids = list(blocks)
        nxt -= nb
        out.scheduled.append(ScheduledRequest(req, new, done))
        out.num_batched_tokens += new
        for pos in range(done, done + new):
            want["input_ids"].append(3 + pos)
            want["positions"].append(pos)
            want["slot_mapping"].append(blocks[pos // block_size] * block_size + pos % block_size)
        want["query_start_loc"].append(want["query_start_loc"][-1] + new)
        want["seq_lens"].append(done + new)
        want["block_tables"].append(blocks)
        if done + new == known:
            want["logit_rows"].append(want["query_start_loc"][-1] - 1)
    return out, want


def test_prefill_graphs_load_what_the_step_holds():
    """What a replayed prefill graph reads after load(), over steps of different shapes one after
    another (a shorter step after a longer one, so a stale row or a stale padding value would show):
    the step's tokens (ids, positions, slots) then padding to the bucket (id and position 0, the scratch
    slot), the sequences' starts then padded sequences' (no tokens: all at n), their lengths then 0,
    their block-table rows (0s to the widest row, then the out-of-range id), and the sampling rows then 0."""
    lay = CacheLayout(device=CPU, block_size=4, num_blocks=64, max_blocks_per_seq=12)
    pg = PrefillGraphs(_ctx(lay), max_tokens=64, max_seqs=4)
    steps = [[(40, 0, 33), (9, 2, 7)], [(20, 16, 4)], [(5, 0, 5), (30, 20, 10), (17, 16, 1)], [(3, 0, 3)],
             [(12, 4, 8), (25, 0, 24)]]  # the last: no sequence samples its first (a chunk), one sampler
    for specs in steps:
        out, want = _step(specs, lay.block_size)
        t, rows, longest = pg.load(out)
        n, s = len(want["input_ids"]), len(specs)
        assert t == next(b for b in pg.buckets if b >= n) and t >= n, (specs, t)
        assert (rows, longest) == (len(want["logit_rows"]), max(want["seq_lens"])), specs
        pad = t - n
        assert pg.input_ids[:t].tolist() == want["input_ids"] + [0] * pad, specs
        assert pg.positions[:t].tolist() == want["positions"] + [0] * pad, specs
        assert pg.slot_mapping[:t].tolist() == want["slot_mapping"] + [lay.pad_slot] * pad, specs
        assert pg.query_start_loc.tolist() == want["query_start_loc"] + [n] * (4 - s), specs
        assert pg.seq_lens.tolist() == want["seq_lens"] + [0] * (4 - s), specs
        assert pg.logit_rows.tolist() == want["logit_rows"] + [0] * (4 - len(want["logit_rows"])), specs
        w = max(len(b) for b in want["block_tables"])  # the step's widest row; shorter rows end in 0s to it
        for i, blocks in enumerate(want["block_tables"]):
            assert pg.block_tables[i].tolist() == blocks + [0] * (w - len(blocks)) + [lay.num_blocks] * (12 - w), (
                specs, i)
