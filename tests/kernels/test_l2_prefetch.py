"""The L2 prefetch beside a decode step's attention (kernels/l2_prefetch.py): a hint that changes no
result. Off CUDA it is a no-op; its PTX and a GPU engine's tokens are checked in
test_kernel_compile_sm90.py and tests/workers/engine/test_gpu.py."""

from __future__ import annotations

import torch

from kernels.l2_prefetch import l2_prefetch, prefetch_beside


def test_prefetch_off_cuda_only_runs_the_block():
    ran = []
    for t in (None, torch.ones(4)):
        with prefetch_beside(t):
            ran.append(t)
    assert len(ran) == 2
    assert l2_prefetch(torch.ones(3, 5)) is None


def test_engine_with_the_prefetch_switch_names_the_weight_its_gemm_reads(monkeypatch):
    """FIRSTTOKEN_L2_PREFETCH=1: each layer prefetches o_proj's weight as its GEMM reads it (the
    e4m3 copy under FP8, the bf16/fp32 weight otherwise), and the tokens are those of the engine without it."""
    from schemas.sampling import SamplingParams
    from workers.engine import EngineConfig, LLMEngine

    sp = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = {}
    for flag in ("1", "0"):
        monkeypatch.setenv("FIRSTTOKEN_L2_PREFETCH", flag)
        for quant in (None, "fp8"):
            eng = LLMEngine("tiny", EngineConfig(device="cpu", quantization=quant))
            attn = eng.runner.model.layers[0].self_attn
            assert attn.l2_prefetch == (flag == "1")
            w = attn._o_weight()
            assert w.dtype == (torch.float8_e4m3fn if quant else attn.o_proj.weight.dtype)
            for i, p in enumerate(["The quick brown fox", "def f(x):"]):
                eng.add_request(f"{i}", prompt=p, sampling=sp)
            got = {}
            while eng.has_unfinished():
                for f in eng.step().finished:
                    got[f.request_id] = f.output_token_ids
            outs[(flag, quant)] = got
    assert outs[("1", None)] == outs[("0", None)] and outs[("1", "fp8")] == outs[("0", "fp8")]
