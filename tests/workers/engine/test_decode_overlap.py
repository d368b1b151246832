"""The overlapped decode halves (EngineConfig.decode_overlap_min_batch): a decode graph's batch as two
halves in turns on two streams (LlamaForCausalLM.forward_pair). Here on the CPU, one stream and no
capture: the halves' forward gives the whole batch's logits and writes the same cache; the GPU test
(tests/workers/engine/test_gpu.py::test_cuda_overlapped_decode_halves_match_transformers) replays it."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine
from workers.engine.cuda_graphs import DecodeGraphs

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_decode_overlap_min_batch_is_checked():
    for bad in (0, 1, -4):
        with pytest.raises(ValueError, match="decode_overlap_min_batch"):
            EngineConfig(decode_overlap_min_batch=bad)
    assert EngineConfig(decode_overlap_min_batch=2).decode_overlap_min_batch == 2
    assert EngineConfig().decode_overlap_min_batch is None  # opt-in


def _decoding(n: int) -> tuple[LLMEngine, object]:
    """A CPU engine with n prompts prefilled (different lengths, so different blocks and positions)
    and the next step, n decodes, scheduled."""
    eng = LLMEngine("tiny", EngineConfig(device="cpu", kernel_backend="torch", block_size=16,
                                         max_num_batched_tokens=512, max_num_seqs=8))
    rng = random.Random(n)
    for i in range(n):
        eng.add_request(f"d{i}", prompt_token_ids=[rng.randrange(3, 500) for _ in range(9 + 7 * i)], sampling=SP)
    eng.step()
    out = eng.scheduler.schedule()
    assert out.num_decodes == n
    return eng, out


@pytest.mark.parametrize(("real", "bucket"), [(5, 8), (8, 8), (3, 3)])
def test_overlapped_halves_give_the_batch_logits_and_cache(real, bucket):
    """`real` decodes in a bucket of `bucket` rows (padding past them), as two halves (ceil(bucket / 2)
    rows, then the rest; padding in the second): the eager step's logits for the real rows, its
    greedy tokens, and the same K/V written to the cache; and the bucket below the threshold runs whole."""
    eng, out = _decoding(real)
    r = eng.runner
    ctx = dataclasses.replace(r.graph_context(8), decode_splits=lambda bs: None)  # (the torch op takes no split count)
    dg = DecodeGraphs(ctx, max_bs=8, overlap_min_batch=3)
    assert dg.overlaps(bucket) and not dg.overlaps(2)
    _ids, _pos, _slots, tables, _qsl, seq_lens, _rows = r.host_inputs(out)
    with torch.inference_mode():
        ids, pos, meta, _ = r.prepare(out)
        hidden, residual = r.model(ids, pos, r.cos_sin, r.kv_caches, meta)
        want = r.model.compute_logits(hidden, residual)
        k_want = [(k.clone(), v.clone()) for k, v in r.kv_caches]
        slots = meta.slot_mapping.clone()
        for k, v in r.kv_caches:  # the new tokens' K/V must come back from the halves' forward
            k.view(-1, *k.shape[2:])[slots] = 0
            v.view(-1, *v.shape[2:])[slots] = 0
        dg.input_ids[:real].copy_(ids)
        dg.positions[:real].copy_(pos)
        dg.slot_mapping[:real].copy_(meta.slot_mapping)
        dg.block_tables[:real, : tables.shape[1]].copy_(torch.from_numpy(tables))
        dg.seq_lens[:real].copy_(torch.from_numpy(seq_lens))
        got = dg._forward(bucket)[:real].clone()
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).tolist() == want.argmax(-1).tolist()
    for (k, v), (kw, vw) in zip(r.kv_caches, k_want):
        torch.testing.assert_close(k.view(-1, *k.shape[2:])[slots], kw.view(-1, *kw.shape[2:])[slots])
        torch.testing.assert_close(v.view(-1, *v.shape[2:])[slots], vw.view(-1, *vw.shape[2:])[slots])


def test_forward_pair_splits_where_asked():
    """The model's two-half forward, split unevenly (1 and 3 sequences): each half's rows are the whole
    batch's (hidden and residual), so no row of one half reads the other's metadata."""
    eng, out = _decoding(4)
    r = eng.runner
    with torch.inference_mode():
        ids, pos, meta, _ = r.prepare(out)
        hidden, residual = r.model(ids, pos, r.cos_sin, r.kv_caches, meta)
        halves = []
        for lo, hi in ((0, 1), (1, 4)):
            halves.append(dataclasses.replace(
                meta, slot_mapping=meta.slot_mapping[lo:hi], num_decodes=hi - lo, num_decode_tokens=hi - lo,
                decode_block_tables=meta.decode_block_tables[lo:hi], decode_seq_lens=meta.decode_seq_lens[lo:hi]))
        (ha, ra), (hb, rb) = r.model.forward_pair(ids, pos, r.cos_sin, r.kv_caches, tuple(halves), 1, None)
    assert ha.shape[0] == 1 and hb.shape[0] == 3
    torch.testing.assert_close(torch.cat([ha, hb]), hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat([ra, rb]), residual, rtol=1e-5, atol=1e-5)
