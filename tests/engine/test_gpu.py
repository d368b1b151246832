"""On a CUDA GPU (never in CI): Triton kernels + CUDA graphs give transformers' exact greedy tokens.

Run there with `FIRSTTOKEN_GPU_TESTS=1 python3 -m pytest -m gpu tests/engine/test_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from schemas.sampling import SamplingParams
from tests.engine.conftest import prompt_set, run_prompts
from workers.engine import EngineConfig, LLMEngine

pytestmark = pytest.mark.gpu

MAX_NEW = 16


def hf_greedy_cuda(path, prompts):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").cuda().eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device="cuda")
            g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False,
                               eos_token_id=None, pad_token_id=0)
            outs.append(g[0, len(p):].tolist())
    return outs


def run(path, prompts, **cfg):
    eng = LLMEngine(str(path), EngineConfig(device="cuda", dtype="float32", kernel_backend="triton",
                                            num_blocks=256, max_model_len=512, **cfg))
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return eng, [f.output_token_ids for f in run_prompts(eng, prompts, sp)]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_engine_matches_transformers(llama_dir, graphs):
    prompts = prompt_set(12, seed=3, min_len=3, max_len=150)
    prompts.append(prompts[-1][:100] + [5, 6, 7])  # a prefix hit
    want = hf_greedy_cuda(llama_dir, prompts)
    eng, got = run(llama_dir, prompts, cuda_graphs=graphs, block_size=16)
    assert (eng.runner.graphs is not None) == graphs
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("ckpt", ["qwen2_dir", "mistral_dir", "llama3_dir"])
def test_cuda_other_architectures(ckpt, request):
    path = request.getfixturevalue(ckpt)
    prompts = prompt_set(6, seed=4, min_len=5, max_len=90)
    want = hf_greedy_cuda(path, prompts)
    _, got = run(path, prompts, max_num_batched_tokens=64)  # chunked prefill too
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_dense_prefill_path(llama_dir):
    # long uncached prompts alone in a step go through SDPA instead of the paged kernel
    prompts = prompt_set(4, seed=8, min_len=100, max_len=300)
    want = hf_greedy_cuda(llama_dir, prompts)
    _, got = run(llama_dir, prompts, dense_prefill_min_tokens=64, prefill_graph_max_tokens=32,
                   max_num_batched_tokens=512, max_num_seqs=1)
    assert got == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("graphs", [True, False])
def test_cuda_serving_never_compiles_after_start(graphs):
    """Every Triton variant is compiled at start-up: a mixed workload (decodes, chunked and
    split prefills, batch sizes from 1 to 48) launches no new specialisation."""
    import random

    from kernels._triton import _KERNELS, kernel_compiles

    eng = LLMEngine("tiny", EngineConfig(device="cuda", dtype="bfloat16", kernel_backend="triton", num_blocks=512,
                                         max_model_len=1024, max_num_seqs=48, max_num_batched_tokens=384,
                                         cuda_graphs=graphs, prefill_graph_max_tokens=64, prefill_graph_max_seqs=4))
    before = kernel_compiles()
    keys = {k.fn.__name__: set(k._compiled) for k in _KERNELS}
    rng = random.Random(5)
    paths = set()
    for i in range(3):  # a few short prompts alone: steps that replay a prefill graph
        sp = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
        eng.add_request(f"s{i}", prompt_token_ids=[rng.randrange(5, 250) for _ in range(9 + i)], sampling=sp)
    while eng.has_unfinished():
        eng.step()
        paths.add(eng.runner.last_path)
    for i in range(120):
        n = rng.choice([1, 2, 15, 16, 17, 63, 100, 333, 700])
        sp = SamplingParams(max_tokens=rng.randint(1, 40), temperature=0.0, ignore_eos=True)
        eng.add_request(f"r{i}", prompt_token_ids=[rng.randrange(5, 250) for _ in range(n)], sampling=sp)
    while eng.has_unfinished():
        eng.step()
        paths.add(eng.runner.last_path)
    assert paths >= ({"eager", "decode_graph", "prefill_graph"} if graphs else {"eager"})
    new = {k.fn.__name__: set(k._compiled) - keys.get(k.fn.__name__, set()) for k in _KERNELS}
    assert kernel_compiles() == before, {n: v for n, v in new.items() if v}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp8_kv_cache_kernels_match_reference(llama_dir):
    """With an fp8 KV cache, the Triton kernels + graphs give the torch reference's greedy tokens
    (both quantize K/V the same way on the GPU: round to nearest even)."""
    prompts = prompt_set(10, seed=21, min_len=5, max_len=150)
    outs = []
    for backend, graphs in (("torch", False), ("triton", True)):
        eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="float32", kernel_backend=backend,
                                                     cuda_graphs=graphs, num_blocks=256, max_model_len=512,
                                                     kv_cache_dtype="fp8"))
        assert eng.runner.kv_caches[0][0].dtype == torch.float8_e4m3fn
        sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        outs.append([f.output_token_ids for f in run_prompts(eng, prompts, sp)])
    assert outs[0] == outs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefill_graph_splits_only_long_contexts(llama_dir):
    """A prefill graph replays its split-attention capture only when the step's context needs it
    (a long cached prefix); short contexts replay the unsplit capture. Tokens stay exact."""
    long = prompt_set(1, seed=31, min_len=1400, max_len=1400)[0]
    cases = [long, long[:1392] + [5, 9, 11, 13, 17, 19, 23, 29], prompt_set(1, seed=32, min_len=30, max_len=30)[0]]
    want = hf_greedy_cuda(llama_dir, cases)
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="float32", kernel_backend="triton",
                                                 num_blocks=512, max_model_len=2048, prefill_graph_max_tokens=64,
                                                 max_num_batched_tokens=2048))
    pg = eng.runner.prefill_graphs
    assert any(s > 1 for (_t, s) in pg.graphs) and any(s == 1 for (_t, s) in pg.graphs)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got, splits = [], []
    for i, p in enumerate(cases):
        pg.last_splits = 0
        got.append(run_prompts(eng, [p], sp, tag=f"c{i}")[0].output_token_ids)
        splits.append(pg.last_splits)
    assert got == want
    assert splits[0] == 0  # 1400 new tokens: eager, no prefill graph
    assert splits[1] > 1  # 8 new tokens over a 1392-token cached prefix: split
    assert splits[2] == 1  # 30 tokens, nothing cached: unsplit


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_engine_in_its_own_process_matches_in_process():
    """The worker's default: the engine core in a spawned child (CUDA initialised there, graphs
    captured there) gives the tokens of the same engine in this process."""
    import time

    from workers.engine_core import AddRequest, ProcessCore

    cfg = {"device": "cuda", "kernel_backend": "triton", "num_blocks": 256, "max_model_len": 512}
    texts = [f"prompt {i} " * (i + 1) for i in range(12)]
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    eng = LLMEngine("tiny", EngineConfig(**cfg))
    for i, t in enumerate(texts):
        eng.add_request(f"r{i}", prompt=t, sampling=sp)
    want = {}
    while eng.has_unfinished():
        want.update((f.request_id, f.output_token_ids) for f in eng.step().finished)
    core = ProcessCore("tiny", EngineConfig(**cfg))
    got: dict = {}
    try:
        assert core.info["device"].startswith("cuda")
        core.submit([AddRequest(f"r{i}", t, None, sp) for i, t in enumerate(texts)])
        deadline = time.monotonic() + 120
        while len(got) < len(texts) and time.monotonic() < deadline:
            out = core.get(1.0)
            if out is not None:
                got.update((f.request_id, f.output_token_ids) for f in out.finished)
    finally:
        core.stop()
    assert len(want) == len(texts) and got == want


def test_cuda_fp8_gemms_match_their_reference():
    """The FP8 GEMMs the engine runs on the GPU (torch._scaled_mm per channel; the Triton kernel
    per group of columns) against the fp32 reference of the same quantized operands."""
    from kernels.fp8_gemm import fp8_gemm_grouped_triton
    from kernels.fp8_linear import (
        fp8_gemm_ref,
        fp8_linear_ref,
        fp8_linear_scaled_mm,
        quantize_groupwise,
        quantize_rowwise,
    )

    g = torch.Generator(device="cuda").manual_seed(0)
    for t, k, n in ((1, 4096, 6144), (77, 4096, 4096), (512, 14336, 4096)):
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        wq, ws = quantize_rowwise(w)
        got, want = fp8_linear_scaled_mm(x, wq, ws), fp8_linear_ref(x, wq, ws)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
        wg, wgs = quantize_groupwise(w, 128)
        xq, xs = quantize_rowwise(x)
        got = fp8_gemm_grouped_triton(xq, xs, wg, wgs, None, torch.float32)
        want = fp8_gemm_ref(xq, xs, wg, wgs, None, torch.float32)
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-3)
        xbq, xbs = quantize_groupwise(x, 128)  # block-wise: activations per token and 128 columns too
        got = fp8_gemm_grouped_triton(xbq, xbs, wg, wgs, None, torch.float32)
        want = fp8_gemm_ref(xbq, xbs, wg, wgs, None, torch.float32)
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-3)


@pytest.mark.parametrize(("group", "act_group"), [(None, None), (32, None), (32, 32)])
def test_cuda_engine_serves_fp8_projections_with_graphs(llama_dir, group, act_group):
    """quantization="fp8" on CUDA, CUDA graphs on: it serves, and stays close to the bf16 engine."""
    prompts = prompt_set(6)
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    outs = {}
    for q in (None, "fp8"):
        eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="bfloat16", kernel_backend="triton",
                                                     num_blocks=256, max_model_len=512, quantization=q,
                                                     fp8_weight_group=group if q else None,
                                                     fp8_act_group=act_group if q else None))
        outs[q] = [f.output_token_ids for f in run_prompts(eng, prompts, sp)]
    same = sum(a == b for x, y in zip(outs[None], outs["fp8"]) for a, b in zip(x, y))
    assert all(len(o) == MAX_NEW for o in outs["fp8"]) and same >= len(prompts) * MAX_NEW // 2


def test_cuda_logprobs_under_graphs_and_async_scheduling(llama_dir):
    """Log-probabilities read back with the tokens when decode steps replay CUDA graphs and the
    host runs a step ahead: one per output token, the greedy token the likeliest, beside
    requests that asked for none (only the rows that asked are computed)."""
    prompts = prompt_set(6)
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="bfloat16", kernel_backend="triton",
                                                 num_blocks=256, max_model_len=512))
    assert eng.runner.graphs is not None
    asked = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", prompt_token_ids=p, sampling=asked if i % 2 == 0 else plain)
    done = {}
    while eng.has_unfinished():
        for f in eng.step().finished:
            done[f.request_id] = f
    for i in range(len(prompts)):
        f = done[f"r{i}"]
        if i % 2:
            assert f.logprobs is None
            continue
        assert f.logprobs is not None and [lp.token_id for lp in f.logprobs] == f.output_token_ids
        for lp in f.logprobs:
            assert len(lp.top) == 3 and lp.top[0][0] == lp.token_id and lp.logprob <= 0.0
            assert lp.top[0][1] >= lp.top[1][1] >= lp.top[2][1]


def test_cuda_prompt_logprobs_beside_graph_steps(llama_dir):
    """A request scoring its prompt runs its prefill steps eagerly while others decode through
    graphs; its prompt log-probabilities are close to the fp32 CPU engine's."""
    prompts = prompt_set(4, min_len=40, max_len=120)
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = {}
    for device, dtype in (("cuda", "bfloat16"), ("cpu", "float32")):
        eng = LLMEngine(str(llama_dir), EngineConfig(device=device, dtype=dtype, num_blocks=256, max_model_len=512,
                                                     max_num_batched_tokens=64))
        for i, p in enumerate(prompts):
            eng.add_request(f"r{i}", prompt_token_ids=p, sampling=sp if i == 3 else plain)
        done = {}
        while eng.has_unfinished():
            for f in eng.step().finished:
                done[f.request_id] = f
        got[device] = done["r3"].prompt_logprobs
    assert got["cuda"] is not None and len(got["cuda"]) == len(prompts[3]) and got["cuda"][0] is None
    diffs = [abs(a.logprob - b.logprob) for a, b in zip(got["cuda"][1:], got["cpu"][1:])]
    assert max(diffs) < 0.1, max(diffs)  # bf16 against fp32
