"""One host-to-device copy of a graph's static inputs (step_inputs.PackedInputs), and the prefill
graphs' load through it (the default) against their seven copies (FIRSTTOKEN_PACKED_INPUTS=0), on the CPU."""

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


def _step(specs: list[tuple[int, int, int]], block_size: int) -> SchedulerOutput:
    """(tokens known, computed before the step, computed now) per sequence; blocks numbered backwards."""
    out = SchedulerOutput()
    nxt = 200
    for i, (known, done, new) in enumerate(specs):
        req = Request(f"r{i}", list(range(3, 3 + known)), known, SamplingParams(max_tokens=1), 0, i, RequestTimes(0.0))
        nb = -(-(done + new) // block_size)
        req.block_ids = list(range(nxt, nxt - nb, -1))
        nxt -= nb
        out.scheduled.append(ScheduledRequest(req, new, done))
        out.num_batched_tokens += new
    return out


def test_prefill_graphs_packed_load_equals_the_copies(monkeypatch):
    """What a replayed prefill graph reads after load(): the same with one packed copy as with the seven
    copies, over steps of different shapes one after another (a shorter step after a longer one, so a
    stale row would show): the bucket's tokens, ids, positions, slots (padding to the scratch slot),
    the sequences' starts, lengths, block-table rows and sampling rows."""
    lay = CacheLayout(device=CPU, block_size=4, num_blocks=64, max_blocks_per_seq=12)
    monkeypatch.setenv("FIRSTTOKEN_PACKED_INPUTS", "0")
    plain = PrefillGraphs(_ctx(lay), max_tokens=64, max_seqs=4)
    monkeypatch.delenv("FIRSTTOKEN_PACKED_INPUTS")
    packed = PrefillGraphs(_ctx(lay), max_tokens=64, max_seqs=4)  # the default
    assert packed.packed_load and not plain.packed_load
    steps = [[(40, 0, 33), (9, 2, 7)], [(20, 16, 4)], [(5, 0, 5), (30, 20, 10), (17, 16, 1)], [(3, 0, 3)]]
    for specs in steps:
        out = _step(specs, lay.block_size)
        got = packed.load(out)
        want = plain.load(out)
        assert got == want
        t, _rows, _longest = got
        s = len(specs)
        w = max(-(-(d + n) // lay.block_size) for _k, d, n in specs)
        n = sum(new for *_x, new in specs)
        # the copies leave a padded row's id and position as the last step left them (its K/V go to the
        # scratch slot and its logits are not read); the packed load sets them to 0
        for name, upto in (("input_ids", n), ("positions", n), ("slot_mapping", t), ("logit_rows", 4),
                           ("query_start_loc", 5), ("seq_lens", 4)):
            assert torch.equal(getattr(packed, name)[:upto], getattr(plain, name)[:upto]), (specs, name)
        assert torch.equal(packed.block_tables[:s, :w], plain.block_tables[:s, :w]), specs
        assert (packed.slot_mapping[n:t] == lay.pad_slot).all()
        assert (packed.input_ids[n:t] == 0).all() and (packed.positions[n:t] == 0).all()
