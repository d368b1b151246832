"""The mixed graphs' layout (decode rows padded to a bucket, then the prompt rows padded to theirs)
computes what the eager step computes: checked on the CPU by running the graphs' forward eagerly
over their static inputs (what a capture records), with the torch kernels and with the Triton
kernels through the interpreter. On a GPU the replayed graphs are checked against eager steps
by tests/workers/engine/test_gpu.py."""

from __future__ import annotations

import random

import pytest
import torch

from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine
from workers.engine.cuda_graphs import MixedGraphs, mixed_decode_buckets, mixed_token_buckets


def test_mixed_buckets():
    assert mixed_decode_buckets(512) == [16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert mixed_decode_buckets(100) == [16, 32, 64, 96, 100]
    assert mixed_decode_buckets(8) == [8]
    assert mixed_token_buckets(1024) == [64, 128, 256, 384, 512, 640, 768, 896, 1024]
    assert mixed_token_buckets(300) == [64, 128, 256, 300]
    assert mixed_token_buckets(48) == [48]


def _decoding_engine(backend: str, n_decodes: int, block_size: int = 4) -> LLMEngine:
    eng = LLMEngine("tiny", EngineConfig(device="cpu", kernel_backend=backend, block_size=block_size,
                                         max_num_batched_tokens=512, max_num_seqs=64))
    rng = random.Random(3)
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    for i in range(n_decodes):
        eng.add_request(f"d{i}", prompt_token_ids=[rng.randrange(3, 500) for _ in range(rng.randint(3, 30))],
                        sampling=sp)
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    eng.step()  # every request decoding, contexts of different lengths
    # new prompts: one shares a cached prefix (a remainder after a prefix hit), one does not
    first = eng.requests["d0"]
    eng.add_request("p0", prompt_token_ids=list(first.token_ids[:12]) + [rng.randrange(3, 500) for _ in range(9)],
                    sampling=sp)
    eng.add_request("p1", prompt_token_ids=[rng.randrange(3, 500) for _ in range(37)], sampling=sp)
    return eng


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_a_mixed_graphs_forward_equals_the_eager_step(backend, monkeypatch):
    if backend == "triton":
        monkeypatch.setenv("TRITON_INTERPRET", "1")
    eng = _decoding_engine(backend, n_decodes=11)
    out = eng.scheduler.schedule()
    nd = out.num_decodes
    assert nd == 11 and len(out.scheduled) == 13, "the step mixes every decode with both prompts"
    assert out.scheduled[nd].num_computed_tokens > 0, "the first prompt's prefix is cached"
    r = eng.runner
    with torch.inference_mode():
        ids, pos, meta, logit_rows = r.prepare(out)
        hidden, residual = r.model(ids, pos, r.cos_sin, r.kv_caches, meta)
        want = r.model.compute_logits(hidden[torch.from_numpy(logit_rows)], residual[torch.from_numpy(logit_rows)])
        # buckets the step does not fill: 11 decodes in 16 rows, 58 prompt tokens in 64
        mg = MixedGraphs(r.graph_context(1), max_decodes=32, max_tokens=128, max_prefills=4)
        assert mg.fits(out)
        db, t, _splits, n = mg.load(out)
        assert (db, t, n) == (16, 64, 13)  # 11 decodes and the last row of each prompt sample
        h, res = mg.forward(db, t, None)
        got = r.model.compute_logits(h[:n], res[:n])
    assert torch.isfinite(want).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (got.argmax(-1) == want.argmax(-1)).all()


def test_what_the_mixed_graphs_do_not_hold():
    eng = _decoding_engine("torch", n_decodes=11)
    out = eng.scheduler.schedule()
    ctx = eng.runner.graph_context(1)
    assert not MixedGraphs(ctx, max_decodes=8, max_tokens=128, max_prefills=4).fits(out)  # 11 decodes > 8
    assert not MixedGraphs(ctx, max_decodes=32, max_tokens=32, max_prefills=4).fits(out)  # 58 prompt tokens > 32
    assert not MixedGraphs(ctx, max_decodes=32, max_tokens=128, max_prefills=1).fits(out)  # 2 chunks > 1
    decode_only = _decoding_engine("torch", n_decodes=5)
    for rid in ("p0", "p1"):
        decode_only.abort(rid)
    step = decode_only.scheduler.schedule()
    assert step.num_decodes == len(step.scheduled) == 5
    # no prompt chunk: the decode graphs' step
    assert not MixedGraphs(decode_only.runner.graph_context(1), 32, 128, 4).fits(step)
