"""The dense prefill graphs' buckets, what they hold, and their forward (run here without capture,
on the CPU) against the eager step: the captured graphs replay exactly this forward on a GPU
(tests/workers/engine/test_gpu.py::test_cuda_dense_prefill_path)."""

from __future__ import annotations

import random

import pytest
import torch

from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine
from workers.engine.cuda_graphs import DenseGraphs, dense_buckets

SP = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_dense_buckets():
    assert dense_buckets(1025, 2048) == [1152, 1280, 1408, 1536, 1664, 1792, 1920, 2048]
    assert dense_buckets(1025, 1100) == [1100]
    assert dense_buckets(64, 300) == [128, 256, 300]
    assert dense_buckets(128, 256) == [128, 256]
    assert dense_buckets(1025, 1024) == []


def test_dense_graph_max_tokens_is_checked():
    with pytest.raises(ValueError, match="dense_graph_max_tokens"):
        EngineConfig(dense_graph_max_tokens=-1)


def _engine() -> LLMEngine:
    return LLMEngine("tiny", EngineConfig(device="cpu", kernel_backend="torch", block_size=16,
                                          max_num_batched_tokens=256, max_num_seqs=4))


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


@pytest.mark.parametrize("n", [100, 128, 129])
def test_a_dense_graphs_forward_equals_the_eager_step(n):
    """A prompt padded to its bucket (100 and 129 tokens: 28 and 127 rows of padding; 128: none)
    gives the eager step's logits for its last token, and writes its K/V where the eager step does."""
    eng = _engine()
    assert eng.runner.dense_graphs is None  # no graphs on a CPU
    eng.add_request("p", prompt_token_ids=_prompt(n, n), sampling=SP)
    out = eng.scheduler.schedule()
    r = eng.runner
    dg = DenseGraphs(r.graph_context(1), 64, 256)
    assert dg.buckets == [128, 256] and dg.fits(out)
    with torch.inference_mode():
        ids, pos, meta, logit_rows = r.prepare(out)  # the CPU's eager step: paged attention
        hidden, residual = r.model(ids, pos, r.cos_sin, r.kv_caches, meta)
        rows = torch.from_numpy(logit_rows)
        want = r.model.compute_logits(hidden[rows], residual[rows])
        k_want = [k.clone() for k, _ in r.kv_caches]
        for k, v in r.kv_caches:
            k.zero_()
            v.zero_()
        t, sampled = dg.load(out)
        assert (t, sampled) == (128 if n <= 128 else 256, 1)
        got = dg._forward(t)[:sampled]
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert got.argmax(-1).item() == want.argmax(-1).item()
    blocks = eng.requests["p"].block_ids
    for (k, _), kw in zip(r.kv_caches, k_want):
        torch.testing.assert_close(k[blocks], kw[blocks])


def _first_step(eng: LLMEngine, *prompts: list[int]):
    """The scheduled first step of these prompts (then aborted: the next case starts clean)."""
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", prompt_token_ids=p, sampling=SP)
    out = eng.scheduler.schedule()
    for i in range(len(prompts)):
        eng.abort(f"q{i}")
    return out


def test_what_the_dense_graphs_do_not_hold():
    eng = _engine()
    ctx = eng.runner.graph_context(1)
    dg = DenseGraphs(ctx, 64, 256)
    assert dg.fits(_first_step(eng, _prompt(96, 2)))  # alone, uncached, within the buckets
    assert not dg.fits(_first_step(eng, _prompt(40, 1)))  # under the dense minimum
    assert not DenseGraphs(ctx, 64, 128).fits(_first_step(eng, _prompt(200, 3)))  # over the largest bucket
    out = _first_step(eng, _prompt(70, 4), _prompt(70, 5))
    assert len(out.scheduled) == 2 and not dg.fits(out)  # two prompts in one step
    prefix = _prompt(96, 6)
    eng.add_request("b", prompt_token_ids=prefix, sampling=SP)
    while eng.has_unfinished():
        eng.step()
    out = _first_step(eng, prefix + _prompt(80, 7))
    assert out.scheduled[0].num_computed_tokens > 0 and not dg.fits(out)  # over a cached prefix


def test_the_graphs_share_one_logits_buffer():
    """Every graph writes its logits into rows of one buffer (a captured output per bucket stayed
    allocated with its graph: 16 GiB at 71 decode buckets up to 1024 on the 8B shape): decode
    buckets and prefill / dense graphs alike, and the rows hold what compute_logits returns
    without it."""
    import dataclasses

    from workers.engine.cuda_graphs import DecodeGraphs

    eng = _engine()
    for i in range(3):
        eng.add_request(f"d{i}", prompt_token_ids=_prompt(20 + i, 10 + i), sampling=SP)
    eng.step()  # the prompts' prefill: their KV in the cache
    out = eng.scheduler.schedule()
    assert out.num_decodes == 3
    r = eng.runner
    ctx = dataclasses.replace(r.graph_context(8), decode_splits=lambda bs: None)  # (the GPU's split count reads its SMs; the torch op takes none)
    dg = DecodeGraphs(ctx, max_bs=8)
    _ids, _pos, _slots, tables, _qsl, seq_lens, _rows = r.host_inputs(out)
    with torch.inference_mode():
        ids, pos, meta, _ = r.prepare(out)
        hidden, residual = r.model(ids, pos, r.cos_sin, r.kv_caches, meta)
        want = r.model.compute_logits(hidden, residual)
        dg.input_ids[:3].copy_(ids)
        dg.positions[:3].copy_(pos)
        dg.slot_mapping[:3].copy_(meta.slot_mapping)
        dg.block_tables[:3, : tables.shape[1]].copy_(torch.from_numpy(tables))
        dg.seq_lens[:3].copy_(torch.from_numpy(seq_lens))
        got4 = dg._forward(4)
        got8 = dg._forward(8)
        decoded = got8[:3].clone()  # the next graph's forward writes the same rows
        with pytest.raises(ValueError, match="logits buffer holds 8"):
            DecodeGraphs(ctx, max_bs=16)._forward(16)  # more rows than the context's buffer
        dense = DenseGraphs(ctx, 64, 256)
        one = dense._forward(128)
    assert got4.untyped_storage().data_ptr() == got8.untyped_storage().data_ptr() == one.untyped_storage().data_ptr()
    assert got8.shape == (8, want.shape[1]) and one.shape == (1, want.shape[1])
    torch.testing.assert_close(decoded, want, rtol=1e-4, atol=1e-4)


def test_prefill_graph_warm_up_spans_and_buckets_stay_inside_the_block_tables():
    """A prefill graph's warm-up spreads its tokens over sequences no longer than a block table holds, and
    its buckets stop at max_seqs such sequences (one sequence of 1024 tokens in a 512-token table read
    past the table's end on the GPU: max_num_seqs=1, an illegal address)."""
    from workers.engine.cuda_graphs import GraphContext, PrefillGraphs, warm_up_spans
    from workers.engine.step_inputs import CacheLayout

    assert warm_up_spans(1024, 512) == [512, 1024]
    assert warm_up_spans(300, 512) == [300]
    assert warm_up_spans(1000, 256) == [256, 512, 768, 1000]
    lay = CacheLayout(torch.device("cpu"), block_size=16, num_blocks=8, max_blocks_per_seq=32)
    ctx = GraphContext(lay, None, None, None, None)
    assert PrefillGraphs(ctx, 1024, 1).buckets[-1] == 512
    assert PrefillGraphs(ctx, 1024, 2).buckets[-1] == 1024
    assert PrefillGraphs(ctx, 384, 4).buckets[-1] == 384
