"""On a CUDA GPU (never in CI): Triton kernels + CUDA graphs give transformers' exact greedy tokens.

Run there with `FIRSTTOKEN_GPU_TESTS=1 python3 -m pytest -m gpu tests/workers/engine/test_gpu.py`.
"""

from __future__ import annotations

import pytest
import torch

from kernels.kv_layout import heads_first
from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import prompt_set, run_prompts
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
@pytest.mark.parametrize("dense_graphs", [True, False])
def test_cuda_dense_prefill_path(llama_dir, dense_graphs):
    """Long uncached prompts alone in a step go through SDPA instead of the paged kernel: eagerly,
    or replaying a dense prefill graph (buckets 128, 256, 384 here: lengths on a bucket, one past
    it, and padded ones); a prompt longer than the budget has its first chunk there too."""
    prompts = prompt_set(4, seed=8, min_len=100, max_len=300) + prompt_set(3, seed=9, min_len=128, max_len=128)
    prompts[5] = prompts[5] + [7]  # 129 tokens: the 256 bucket, 127 rows of padding
    prompts.append(prompt_set(1, seed=10, min_len=450, max_len=450)[0])  # chunks of 384 (dense) and 66
    want = hf_greedy_cuda(llama_dir, prompts)
    eng = LLMEngine(str(llama_dir), EngineConfig(
        device="cuda", dtype="float32", kernel_backend="triton", num_blocks=256, max_model_len=512,
        dense_prefill_min_tokens=64, prefill_graph_max_tokens=32, max_num_batched_tokens=384, max_num_seqs=1,
        dense_graph_max_tokens=2048 if dense_graphs else 0))
    assert (eng.runner.dense_graphs is not None) == dense_graphs
    if dense_graphs:
        assert eng.runner.dense_graphs.buckets == [128, 256, 384]
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = [f.output_token_ids for f in run_prompts(eng, prompts, sp)]
    assert got == want
    assert eng.runner.path_steps.get("dense_graph", 0) == (len(prompts) if dense_graphs else 0), eng.runner.path_steps
    # two choices of one long prompt: the second is forked from the first's dense prefill
    eng.add_request("lead", prompt_token_ids=prompts[0], sampling=sp)
    eng.add_request("fork", prompt_token_ids=prompts[0], sampling=sp, follows="lead")
    done = {}
    while eng.has_unfinished():
        done.update((f.request_id, f.output_token_ids) for f in eng.step().finished)
    assert done == {"lead": want[0], "fork": want[0]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("n_prompt", [67, 64, 150])
def test_cuda_choices_share_the_prompt_blocks_in_one_step(llama_dir, n_prompt):
    """n=4 sequences of one prompt (workers.choices): the three after the first are forked from its
    prefill (its full blocks shared, its partial last block copied on the device after the step,
    graphs and async scheduling on) and give the lone request's greedy tokens, transformers' too."""
    from workers.choices import ChoiceGroups

    prompt = prompt_set(1, seed=11, min_len=n_prompt, max_len=n_prompt)[0]
    want = hf_greedy_cuda(llama_dir, [prompt])[0]
    eng, got = run(llama_dir, [prompt], block_size=16)
    assert got == [want]
    eng.kv.pool.reset_prefix_cache()
    groups = ChoiceGroups(eng)
    groups.add("job", [prompt], [None], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=4))
    done = []
    while eng.has_unfinished():
        done.extend(groups.finished(eng.step().finished))
    (f,) = done
    assert [c.output.usage.cached_prompt_tokens for c in f.choices] == [0, n_prompt, n_prompt, n_prompt]
    assert [c.output.output_token_ids for c in f.choices] == [want] * 4


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("graphs", "fields"), [(True, {}), (False, {}),
                                                (True, {"quantization": "fp8", "fp8_lm_head": True}),
                                                (True, {"_env": {"FIRSTTOKEN_PREFILL_PREFETCH": "1"}})])
def test_cuda_serving_never_compiles_after_start(graphs, fields, monkeypatch):
    """Every Triton variant is compiled at start-up: a mixed workload (decodes, chunked and
    split prefills, batch sizes from 1 to 48) launches no new specialisation (also with the
    FP8 projections and lm_head: its GEMV, few-row GEMM and fused final norm; and with the prefill
    attention's block ids a tile ahead, whose 3 stages the warm-up compiles)."""
    import random

    from kernels._triton import _KERNELS, kernel_compiles

    fields = dict(fields)
    for name, value in fields.pop("_env", {}).items():
        monkeypatch.setenv(name, value)

    eng = LLMEngine("tiny", EngineConfig(device="cuda", dtype="bfloat16", kernel_backend="triton", num_blocks=512,
                                         max_model_len=1024, max_num_seqs=48, max_num_batched_tokens=384,
                                         cuda_graphs=graphs, prefill_graph_max_tokens=64, prefill_graph_max_seqs=4,
                                         **fields))
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
def test_cuda_packed_prefill_graph_inputs_match_transformers(llama_dir):
    """The prefill graphs' inputs staged in one pinned buffer and sent in one copy a step, under async
    scheduling (a staging buffer is reused only after its copy ran). Each prompt alone replays a prefill
    graph, some over a cached prefix (a 40-token hit + 3 new), a short step after a longer one; then all
    at once, back to back. fp32: the greedy tokens are transformers'."""
    prompts = prompt_set(8, seed=7, min_len=5, max_len=60)
    prompts += [p[:40] + [9, 8, 7] for p in prompts if len(p) >= 40][:3]
    want = hf_greedy_cuda(llama_dir, prompts)
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="float32", kernel_backend="triton",
                                                 num_blocks=256, max_model_len=512, prefill_graph_max_tokens=64,
                                                 async_scheduling=True))
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    alone = [run_prompts(eng, [p], sp, tag=f"p{k}-")[0].output_token_ids for k, p in enumerate(prompts)]
    assert eng.runner.path_steps.get("prefill_graph", 0) >= len(prompts), eng.runner.path_steps
    together = [f.output_token_ids for f in run_prompts(eng, prompts, sp, tag="all-")]
    eng.close()
    assert alone == want
    assert together == want


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_bf16_head_writes_fp32_logits_from_its_accumulator(llama_dir):
    """A bf16 model's lm_head on CUDA writes fp32 logits from the GEMM's fp32 accumulator, into the graphs'
    shared buffer too: within fp32 summation error of a float64 product of the same bf16 operands, where the
    bf16 GEMM then a cast (FIRSTTOKEN_LOGITS_FP32_GEMM=0) rounds each logit to bf16, 2^-9 relative (this bound
    fails it: checked below)."""
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="bfloat16", kernel_backend="triton",
                                                 num_blocks=256, max_model_len=512))
    model = eng.runner.model
    assert model.logits_fp32_gemm
    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn((37, model.cfg.hidden_size), device="cuda", dtype=torch.bfloat16, generator=g) * 4
    residual = torch.randn_like(hidden)
    h, _ = model.norm(hidden.clone(), residual.clone())
    ref = h.double() @ model.lm_head_weight.double().t()
    bound = 2e-4 * ref.abs().max().item()
    got = model.compute_logits(hidden.clone(), residual.clone())
    buf = torch.full((64, ref.shape[1]), float("nan"), device="cuda")
    into = model.compute_logits(hidden.clone(), residual.clone(), buf[:37])
    assert got.dtype == torch.float32 and into.data_ptr() == buf.data_ptr() and torch.equal(into, got)
    err = (got.double() - ref).abs().max().item()
    model.logits_fp32_gemm = False
    old = model.compute_logits(hidden.clone(), residual.clone())
    old_err = (old.double() - ref).abs().max().item()
    measured("bf16_head_fp32_logits", {"err": err, "bf16_then_cast_err": old_err, "bound": bound})
    assert err < bound < old_err
    eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize(("layout", "k_layout", "tiles"), [("rows", "nhd", None), ("keys_inner", "nhd", None),
                                                        ("keys_inner", "hnd", None),
                                                        ("keys_inner", "nhd", '{"prefetch": false}')])
def test_cuda_blocks_of_64_match_transformers(llama_dir, monkeypatch, layout, k_layout, tiles):
    """KV blocks of 64 tokens (an fp8 cache's default: V keys inner, the block ids a tile ahead; V in rows, K heads
    first and no prefetch beside it), through the decode and prefill graphs, chunked prefill and a prefix hit of
    whole 64-token blocks: transformers' greedy tokens exactly (fp32)."""
    if tiles:
        monkeypatch.setenv("FIRSTTOKEN_DECODE_TILES", tiles)
    prompts = prompt_set(10, seed=12, min_len=3, max_len=200)
    prompts.append(prompts[-1][:150] + [5, 6, 7])  # two 64-token blocks cached
    want = hf_greedy_cuda(llama_dir, prompts)
    eng, got = run(llama_dir, prompts, block_size=64, kv_cache_v_layout=layout, kv_cache_k_layout=k_layout,
                   max_num_batched_tokens=96)
    assert eng.runner.graphs is not None and eng.runner.v_layout == layout
    assert heads_first(eng.runner.kv_caches[0][0]) == (k_layout == "hnd")
    assert got == want
    eng.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp8_kv_v_layouts_agree(llama_dir):
    """bf16 with an fp8 KV cache as served (Triton, graphs, fp16-widened tiles, blocks of 64): V keys inner (the
    default), V in rows and K heads first compute the same tiles in the same order, so the greedy tokens are the
    same, prefix hits and decode graphs included."""
    prompts = prompt_set(8, seed=3, min_len=5, max_len=200)
    prompts.append(prompts[-1][:150] + [5, 6, 7])
    outs = {}
    for layout, k_layout in (("rows", "nhd"), ("keys_inner", "nhd"), ("keys_inner", "hnd")):
        eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="bfloat16", kernel_backend="triton",
                                                     num_blocks=64, max_model_len=512, kv_cache_dtype="fp8",
                                                     kv_cache_v_layout=layout, kv_cache_k_layout=k_layout))
        assert eng.runner.v_layout == layout and eng.runner.block_size == 64
        sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
        done = run_prompts(eng, prompts, sp)
        assert done[-1].usage.cached_prompt_tokens > 0
        outs[layout, k_layout] = [f.output_token_ids for f in done]
        eng.close()
    assert outs["rows", "nhd"] == outs["keys_inner", "nhd"] == outs["keys_inner", "hnd"]


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


def _staggered(eng, prompts, per_step: int, max_tokens: int) -> list[list[int]]:
    """Serve the prompts arriving `per_step` a step while earlier ones decode (mixed steps)."""
    sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    todo, done = list(enumerate(prompts)), {}
    while todo or eng.has_unfinished():
        for _ in range(per_step):
            if todo:
                i, p = todo.pop(0)
                eng.add_request(f"s{i}", prompt_token_ids=p, sampling=sp)
        for f in eng.step().finished:
            done[f.request_id] = f.output_token_ids
    return [done[f"s{i}"] for i in range(len(prompts))]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_mixed_graphs_replay_what_eager_steps_compute(llama_dir):
    """Prompts arriving while dozens of requests decode: the steps that mix them replay mixed
    graphs (decode kernel for the decodes, prefill kernel for the chunks, padded to buckets) and
    give the tokens of the same steps run eagerly, and of transformers."""
    prompts = prompt_set(48, seed=41, min_len=20, max_len=160)
    prompts[40] = prompts[3][:96] + [5, 6, 7]  # a prefix hit inside a mixed step
    cfg = dict(device="cuda", dtype="float32", kernel_backend="triton", num_blocks=2048, max_model_len=512,
               max_num_seqs=64, max_num_batched_tokens=512, prefill_graph_max_seqs=4, mixed_graph_max_tokens=256,
               mixed_graph_max_prefills=4, async_scheduling=True)
    eager = LLMEngine(str(llama_dir), EngineConfig(cuda_graphs=False, **cfg))
    want = _staggered(eager, prompts, 3, MAX_NEW)
    eager.close()
    eng = LLMEngine(str(llama_dir), EngineConfig(**cfg))
    got = _staggered(eng, prompts, 3, MAX_NEW)
    steps = eng.runner.path_steps
    assert steps.get("mixed_graph", 0) >= 5, steps
    assert got == want
    assert got[:12] == hf_greedy_cuda(llama_dir, prompts[:12])


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
    """The FP8 GEMMs the engine runs on the GPU (torch._scaled_mm; the few-row kernel, per token
    and per channel like it) against the fp32 reference of the same quantized operands."""
    from kernels.fp8_gemm import fp8_gemm_rowwise_small_m
    from kernels.fp8_linear import fp8_gemm_ref, fp8_linear_ref, fp8_linear_scaled_mm, quantize_rowwise

    g = torch.Generator(device="cuda").manual_seed(0)
    for t, k, n in ((1, 4096, 6144), (77, 4096, 4096), (512, 14336, 4096)):
        x = torch.randn(t, k, device="cuda", dtype=torch.bfloat16, generator=g)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02
        wq, ws = quantize_rowwise(w)
        got, want = fp8_linear_scaled_mm(x, wq, ws), fp8_linear_ref(x, wq, ws)
        assert ((got.float() - want.float()).norm() / want.float().norm()).item() < 1e-2
        xq, xs = quantize_rowwise(x)
        got = fp8_gemm_rowwise_small_m(xq, xs, wq, ws, None, torch.float32)
        want = fp8_gemm_ref(xq, xs, wq, ws, None, torch.float32)
        torch.testing.assert_close(got, want, atol=1e-2, rtol=1e-3)


# ---- FP8: the GPU kernels against their emulation, and FP8's error against fp32 -----------------
# The test model's random weights give logits with a spread of several nats, and FP8's three
# mantissa bits (a relative rounding step of 2^-3 on every weight and activation) move each
# log-probability by ~0.24 nats on average: ten times bf16's 0.025 (H200, 2026-12-01,
# bench/results/2026-12-01-fp8-error-h200.md). So FP8 flips many greedy choices of a random model,
# and one flip changes every later token of a free-running continuation: the 11, 7 and 8 of 96
# tokens equal to the bf16 engine's (231bf73) were FP8's error on near-uniform logits, not a bug.
# What finds a bug is a comparison with FP8's emulation (transformers in fp32 with every projection
# quantized the same way, the GEMM done in fp32 on the CPU): as served (bf16 elsewhere) the GPU's
# FP8 error against fp32 is the emulation's (0.2475 against 0.2470 nats, per channel); with fp32
# elsewhere the GPU engine stays within EMULATION_BOUND of the emulation, which a 5% scale error in
# one projection exceeds (the control below).

FP8_VARIANTS = {"per-channel": {}}  # the one FP8 layout (the group-scaled ones were removed)
# mean |d logprob| of the GPU's FP8 engine (fp32 elsewhere) against the FP8 emulation: 0.049
# teacher-forced and 0.043 decoded through CUDA graphs, per channel (the attention kernels' fp32
# dots run as TF32, and FP8 turns such small differences into whole rounding steps of some
# activations), against 0.076 for the emulation with a 5% scale error in the down projections: the
# bound sits between
EMULATION_BOUND = 0.065
BF16_MEAN_DLP_BOUND = 0.05  # the bf16 engine against fp32: 0.025 measured, x2
SERVED_OVER_EMULATION = 1.5  # FP8 as served (bf16 elsewhere) over the emulation's error, both vs fp32
# the engine's bf16 prompt log-probabilities against fp32, over transformers' bf16 against fp32:
# 0.74 (mean) and 0.85 (max) measured on the H200; kernels that round elsewhere are of that size
PROMPT_LP_RATIO = 1.5


def hf_log_softmax(path, seqs, fp8: dict | None = None, device="cuda", scale_error: float = 1.0,
                   dequantized: bool = False):
    """transformers' fp32 log-softmax at every position of each sequence: [L, V] on the CPU (row p
    scores token p + 1). fp8: the engine's FP8 fields (a FP8_VARIANTS value): every projection
    becomes an Fp8Linear quantized the same way, its GEMM the fp32 reference on the CPU
    (the engine's fused qkv and gate_up have the separate matrices' rows and inputs, so the same
    scales). scale_error multiplies the down projections' weight scales (a planted defect).
    dequantized: each projection's weight replaced by its per-channel e4m3 dequantized (W8A16: what
    the engine's one-row GEMV computes), activations left as they are."""
    from torch import nn
    from transformers import AutoModelForCausalLM

    from workers.engine.quantization import Fp8Linear

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
    if dequantized:
        from kernels.fp8_linear import dequantize, quantize_weight

        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("_proj.weight"):
                    p.copy_(dequantize(*quantize_weight(p)))  # the engine's scales
    if fp8 is not None:
        device = "cpu"
        for module in list(model.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, nn.Linear) and name.endswith("_proj"):
                    q = Fp8Linear(child)
                    if name == "down_proj":
                        q.weight_scale.mul_(scale_error)
                    setattr(module, name, q)
    model = model.to(device)
    with torch.no_grad():
        return [torch.log_softmax(model(torch.tensor([s], device=device)).logits[0].float(), -1).cpu() for s in seqs]


def score_error(ref_rows, lps) -> dict:
    """Per scored position: the engine's TokenLogprob (its top 20) against the reference's row.
    Returns mean |d logprob| over the engine's top tokens, the same for the scored token, and
    top-1 agreement (a tie in the engine counts when the reference's argmax is among the tied)."""
    d_top, d_tok, agree = [], [], 0
    for row, lp in zip(ref_rows, lps):
        d_top.append(sum(abs(v - row[t].item()) for t, v in lp.top) / len(lp.top))
        d_tok.append(abs(lp.logprob - row[lp.token_id].item()))
        agree += int(row.argmax()) in {t for t, v in lp.top if v == lp.top[0][1]}
    n = len(d_top)
    return {"positions": n, "mean_dlp_top": sum(d_top) / n, "max_dlp_top": max(d_top),
            "mean_dlp_token": sum(d_tok) / n, "top1_agreement": agree / n}


def scored_rows(ref, seqs=None):
    """The reference rows that score tokens 1.. of each sequence, flattened."""
    return [r for seq_ref in ref for r in seq_ref[:-1]]


@pytest.fixture(scope="module")
def teacher_forced(llama_dir):
    """Six prompts, each with its fp32 greedy continuation, and the fp32 reference over them."""
    prompts = prompt_set(6, min_len=20, max_len=90)
    seqs = [p + c for p, c in zip(prompts, hf_greedy_cuda(llama_dir, prompts))]
    return seqs, hf_log_softmax(llama_dir, seqs)


def engine_prompt_scores(path, seqs, **cfg):
    """Each sequence's prompt log-probabilities (top 20, tokens 1..) from a CUDA engine, flattened."""
    eng = LLMEngine(str(path), EngineConfig(device="cuda", kernel_backend="triton", num_blocks=256,
                                            max_model_len=512, **cfg))
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=20)
    done = run_prompts(eng, seqs, sp)
    eng.close()
    return [lp for f in done for lp in f.prompt_logprobs[1:]]


def measured(name, result):
    """Print a measurement (pytest -s) and append it to $FIRSTTOKEN_MEASURE_OUT (JSON lines) when set."""
    import json
    import os

    line = json.dumps({"test": name, **result})
    print(line)
    if os.environ.get("FIRSTTOKEN_MEASURE_OUT"):
        with open(os.environ["FIRSTTOKEN_MEASURE_OUT"], "a") as f:
            f.write(line + "\n")


@pytest.mark.parametrize("variant", list(FP8_VARIANTS))
def test_cuda_fp8_engine_matches_its_emulation(llama_dir, teacher_forced, variant):
    """FP8 projections on CUDA (Triton kernels, torch._scaled_mm, fused quantization), fp32
    elsewhere: teacher-forced log-probabilities, and those of its own continuation decoded through
    CUDA graphs, equal the FP8 emulation's within EMULATION_BOUND; a planted 5% scale error fails it."""
    fields = FP8_VARIANTS[variant]
    seqs, _ = teacher_forced
    emu = scored_rows(hf_log_softmax(llama_dir, seqs, fp8=fields))
    tf = score_error(emu, engine_prompt_scores(llama_dir, seqs, dtype="float32", quantization="fp8", **fields))
    # decode steps replaying graphs: the engine's continuation, scored by the emulation
    prompts = prompt_set(6)
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="float32", kernel_backend="triton",
                                                 num_blocks=256, max_model_len=512, quantization="fp8", **fields))
    assert eng.runner.graphs is not None
    done = run_prompts(eng, prompts, SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True,
                                                    logprobs=20))
    path = eng.runner.last_path
    eng.close()
    conts = hf_log_softmax(llama_dir, [p + f.output_token_ids for p, f in zip(prompts, done)], fp8=fields)
    rows = [r[len(p) - 1 + i] for p, f, r in zip(prompts, done, conts) for i in range(MAX_NEW)]
    dec = score_error(rows, [lp for f in done for lp in f.logprobs])
    result = {"teacher_forced": tf, "graph_decode": dec, "last_path": path}
    if variant == "per-channel":  # the control: the same comparison against a defective emulation
        bad = scored_rows(hf_log_softmax(llama_dir, seqs, fp8=fields, scale_error=1.05))
        result["control_5pct_scale_error"] = score_error(bad, engine_prompt_scores(
            llama_dir, seqs, dtype="float32", quantization="fp8", **fields))
        assert result["control_5pct_scale_error"]["mean_dlp_top"] > EMULATION_BOUND, result
    measured(f"fp8_vs_emulation[{variant}]", result)
    assert path == "decode_graph"
    assert tf["mean_dlp_top"] < EMULATION_BOUND, result
    assert dec["mean_dlp_top"] < EMULATION_BOUND, result
    # near-uniform logits: 0.875-0.95 measured (random choice: 1/384); a sanity bound, not the criterion
    assert tf["top1_agreement"] >= 0.8 and dec["top1_agreement"] >= 0.8, result


@pytest.mark.parametrize("variant", list(FP8_VARIANTS))
def test_cuda_fp8_as_served_errs_as_fp8_does(llama_dir, teacher_forced, variant):
    """quantization="fp8" as served (bf16 elsewhere), teacher-forced against transformers in
    fp32: FP8's error is its emulation's (within SERVED_OVER_EMULATION), bf16's beside it is a
    tenth of it."""
    fields = FP8_VARIANTS[variant]
    seqs, ref = teacher_forced
    rows = scored_rows(ref)
    emu = scored_rows(hf_log_softmax(llama_dir, seqs, fp8=fields))
    emu_err = sum((a - b).abs().mean().item() for a, b in zip(emu, rows)) / len(rows)  # over the whole vocabulary
    emu_top = score_error(rows, [_as_logprob(r) for r in emu])
    fp8 = score_error(rows, engine_prompt_scores(llama_dir, seqs, dtype="bfloat16", quantization="fp8", **fields))
    bf16 = score_error(rows, engine_prompt_scores(llama_dir, seqs, dtype="bfloat16"))
    spread = sum(r.std().item() for r in rows) / len(rows)
    measured(f"fp8_as_served[{variant}]", {"fp8": fp8, "bf16": bf16, "emulation": emu_top,
                                           "emulation_mean_dlp_vocab": emu_err, "ref_logprob_std": spread})
    assert bf16["mean_dlp_top"] < BF16_MEAN_DLP_BOUND, bf16
    assert fp8["mean_dlp_top"] < SERVED_OVER_EMULATION * emu_top["mean_dlp_top"], (fp8, emu_top)
    assert fp8["mean_dlp_top"] > 3 * bf16["mean_dlp_top"]  # the FP8 path really ran


def test_cuda_fp8_gemv_matches_its_reference():
    """The W8A16 GEMV on the GPU (each prologue, split K and not) against its reference: the new
    residual bit for bit (the GPU's cast rounds as torch does), the output within its bf16
    rounding, the same bits on every launch (the split parts are added in a fixed order)."""
    from kernels.fp8_gemv import PROLOGUE_NONE, PROLOGUE_RMS, PROLOGUE_SILU, fp8_gemv_ref, fp8_gemv_triton
    from kernels.fp8_linear import quantize

    g = torch.Generator(device="cuda").manual_seed(0)
    for prologue, k, n in ((PROLOGUE_RMS, 4096, 6144), (PROLOGUE_NONE, 4096, 4096), (PROLOGUE_SILU, 14336, 4096)):
        x = torch.randn(1, 2 * k if prologue == PROLOGUE_SILU else k, device="cuda", dtype=torch.bfloat16, generator=g)
        res = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=g)
        nw = (1 + 0.1 * torch.randn(k, device="cuda", generator=g)).to(torch.bfloat16)
        wq, ws = quantize(torch.randn(n, k, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02)
        kw = {"prologue": prologue, "residual": res if prologue == PROLOGUE_RMS else None,
              "norm_weight": nw if prologue == PROLOGUE_RMS else None, "eps": 1e-5}
        want, want_res = fp8_gemv_ref(x, wq, ws, None, **kw)
        for split in (1, 4):
            runs = [fp8_gemv_triton(x, wq, ws, None, **kw, split=split) for _ in range(16)]
            out = runs[0][0]
            err = ((out.float() - want.float()).norm() / want.float().norm()).item()
            assert err < 5e-3, (prologue, split, err)  # the output's bf16 rounding: 2^-9 relative
            assert all(torch.equal(o, out) for o, _ in runs), (prologue, split)
            if prologue == PROLOGUE_RMS:
                assert all(torch.equal(r, want_res) for _, r in runs)


def test_cuda_fp8_decode_at_one_row_is_w8a16(llama_dir):
    """One-token prompts run alone: every step has one row, so every FP8 projection runs the
    W8A16 GEMV (prefill and graph-replayed decode alike). With fp32 elsewhere its log-probabilities
    are those of the model with dequantized e4m3 weights (the W8A16 emulation), well inside the
    distance to the W8A8 emulation, whose quantized activations the GEMV does not compute (H200,
    6802f18: mean |d logprob| below 5e-5 against the W8A16 emulation, 0.138 against the W8A8 one:
    with fp32 elsewhere both sides compute the same products, up to the order of fp32 sums)."""
    prompts = [[p[0]] for p in prompt_set(4, seed=3)]
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="float32", kernel_backend="triton",
                                                 num_blocks=256, max_model_len=512, quantization="fp8"))
    assert eng.runner.graphs is not None
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=20)
    done = [run_prompts(eng, [p], sp, tag=f"one{i}-")[0] for i, p in enumerate(prompts)]
    path = eng.runner.last_path
    eng.close()
    seqs = [p + f.output_token_ids for p, f in zip(prompts, done)]
    lps = [lp for f in done for lp in f.logprobs]

    def rows(ref):
        return [r[len(p) - 1 + i] for p, r in zip(prompts, ref) for i in range(MAX_NEW)]

    w8a16 = score_error(rows(hf_log_softmax(llama_dir, seqs, dequantized=True)), lps)
    w8a8 = score_error(rows(hf_log_softmax(llama_dir, seqs, fp8={})), lps)
    measured("fp8_one_row_w8a16", {"vs_w8a16_emulation": w8a16, "vs_w8a8_emulation": w8a8, "last_path": path})
    assert path == "decode_graph"
    assert w8a16["mean_dlp_top"] < 1e-3, (w8a16, w8a8)  # 5e-5 measured; the W8A8 path would give ~0.14
    assert w8a16["mean_dlp_top"] < 0.1 * w8a8["mean_dlp_top"], (w8a16, w8a8)


def _as_logprob(row):
    """A full reference row as the engine reports it: its top 20 (for score_error)."""
    from workers.engine.outputs import TokenLogprob

    top_lp, top_ids = row.topk(20)
    return TokenLogprob(int(top_ids[0]), float(top_lp[0]), tuple(zip(top_ids.tolist(), top_lp.tolist())))


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
            # the greedy token is a likeliest one: first in the list, or tied with the first. bf16
            # logits tie often (8 mantissa bits: -2.7617 twice at 231bf73), and argmax (the sampler)
            # and topk (the list) need not pick the same one of a tie
            assert len(lp.top) == 3 and lp.logprob <= 0.0
            assert lp.top[0][0] == lp.token_id or lp.logprob == lp.top[0][1], lp
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
    # the yardstick: transformers in bf16 against transformers in fp32, the same prompt, on the GPU.
    # The engine's bf16 error must be of that size (a fixed 0.1 failed at 0.137 at 231bf73: bf16's
    # rounding of these random-weight activations alone gives errors near 0.1)
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([prompts[3]], device="cuda")
    hf = {}
    for dt in (torch.float32, torch.bfloat16):
        m = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=dt, attn_implementation="eager").cuda().eval()
        with torch.no_grad():
            hf[dt] = torch.log_softmax(m(ids).logits[0].float(), -1)[:-1].gather(1, ids[0, 1:, None])[:, 0].cpu()
    hf_diffs = (hf[torch.bfloat16] - hf[torch.float32]).abs()
    measured("prompt_logprobs_bf16", {"engine_max": max(diffs), "engine_mean": sum(diffs) / len(diffs),
                                      "hf_bf16_max": hf_diffs.max().item(), "hf_bf16_mean": hf_diffs.mean().item()})
    assert sum(diffs) / len(diffs) < PROMPT_LP_RATIO * hf_diffs.mean().item(), (diffs, hf_diffs)
    assert max(diffs) < PROMPT_LP_RATIO * hf_diffs.max().item(), (max(diffs), hf_diffs.max())


def cached_prefix_case(bs: int, v_layout: str, seed: int, prefix: int = 2048, new: int = 128) -> tuple:
    """TTFT 2048 cached + 128's paged attention inputs: Llama-3.1-8B heads, an fp8 cache of blocks of `bs` in
    scattered order (V in rows or keys inner), bf16 q. Returns (q, k_cache, v_cache, block_tables,
    query_start_loc, seq_lens, scale, new)."""
    from kernels.kv_layout import to_v_layout

    g = torch.Generator(device="cuda").manual_seed(seed)
    hq, hk, d = 32, 8, 128
    ctx = prefix + new
    nblk = -(-ctx // bs)
    kc = torch.randn((nblk + 4, bs, hk, d), device="cuda", generator=g).to(torch.float8_e4m3fn)
    vc = torch.randn((nblk + 4, bs, hk, d), device="cuda", generator=g).to(torch.float8_e4m3fn)
    if v_layout == "keys_inner":
        vc = to_v_layout(vc, "keys_inner")
    bt = torch.randperm(nblk + 4, device="cuda", generator=g)[None, :nblk].int()
    q = torch.randn((new, hq, d), device="cuda", generator=g).to(torch.bfloat16)
    qsl = torch.tensor([0, new], dtype=torch.int32, device="cuda")
    sl = torch.tensor([ctx], dtype=torch.int32, device="cuda")
    return q, kc, vc, bt, qsl, sl, d**-0.5, new


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefill_attention_k8_matches_its_emulation():
    """The paged prefill attention with widen="k8" (QK^T on the e4m3 wgmma, q rounded by the GPU's cvt) at
    2048 cached + 128 new tokens, Llama-3.1-8B heads, split as the engine splits it: within accumulation
    order of its emulation (paged_attention_ref over q_as_e4m3_ref's q), where the same kernel's fp16 path
    is ~0.001 from exact attention and k8's rounding of q puts it ~0.026 away (H100, 13b18df): a wrong
    scale or a truncating cast would leave the first bound."""
    from kernels.prefill_attention import paged_attention_ref, paged_attention_triton, q_as_e4m3_ref

    q, kc, vc, bt, qsl, sl, scale, new = cached_prefix_case(16, "rows", seed=0)
    exact = paged_attention_ref(q, kc, vc, bt, qsl, sl, scale).float()
    emu = paged_attention_ref(q_as_e4m3_ref(q, scale), kc, vc, bt, qsl, sl, scale).float()

    def rel(a, b):
        return float((a.float() - b).norm() / b.norm())

    result = {}
    for splits in (None, 1):
        out = paged_attention_triton(q, kc, vc, bt, qsl, sl, scale, max_query_len=new, widen="k8", num_splits=splits)
        result[f"splits_{splits}"] = {"vs_emulation": rel(out, emu), "vs_exact": rel(out, exact)}
    result["emulation_vs_exact"] = rel(emu, exact)
    measured("prefill_attention_k8", result)
    # H100 at 836661e: 0.0035 from the emulation, 0.026 from exact (the emulation 0.026 too). Not closer: P
    # rounds to fp16 in the kernel, and Triton's fp32 division is not IEEE's, so a few q values land on
    # the neighbouring e4m3 step
    for splits in (None, 1):
        r = result[f"splits_{splits}"]
        assert r["vs_emulation"] < 0.008 and 0.01 < r["vs_exact"] < 0.05, result


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_prefill_prefetch_gives_the_same_bits():
    """The paged prefill attention with each key tile's block ids loaded a tile ahead (prefetch: two K/V shared
    buffers at 3 stages on sm90) at 2048 cached + 128 new tokens in the engine's fp8 layout (blocks of 64, V
    keys inner, scattered blocks), Llama-3.1-8B heads, split as the engine splits it and unsplit, eagerly and
    replayed in a CUDA graph: the same keys in the same order, so the same bits as without it."""
    from kernels.prefill_attention import paged_attention_ref, paged_attention_triton

    q, kc, vc, bt, qsl, sl, scale, new = cached_prefix_case(64, "keys_inner", seed=1)
    exact = paged_attention_ref(q, kc, vc, bt, qsl, sl, scale).float()
    for splits in (None, 1):
        kw = {"max_query_len": new, "num_splits": splits}
        base = paged_attention_triton(q, kc, vc, bt, qsl, sl, scale, **kw)
        out = paged_attention_triton(q, kc, vc, bt, qsl, sl, scale, prefetch=True, **kw)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = paged_attention_triton(q, kc, vc, bt, qsl, sl, scale, prefetch=True, **kw)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, base) and torch.equal(replayed, base), splits
        assert float((out.float() - exact).norm() / exact.norm()) < 0.005, splits  # the fp16 path's ~0.001


def test_cuda_fp8_attention_matches_its_emulation():
    """cuDNN's FP8 forward (kernels/cudnn_attention.py) against its PyTorch emulation on the same e4m3
    inputs: the same math up to accumulation order, so within 1.5% RMS, where exact attention is ~6% away
    and attention without the causal mask far more; a length padded to its bucket (the length a device
    tensor) gives the unpadded graph's outputs on the real rows."""
    from kernels import cudnn_attention as ca
    from kernels.fp8_quant import cast_e4m3_ref

    why = ca.available("cuda")
    if why is not None:
        pytest.skip(why)
    g = torch.Generator(device="cuda").manual_seed(0)
    t, hq, hk, d = 3000, 32, 8, 128
    qkv = torch.randn((t, (hq + 2 * hk) * d), device="cuda", generator=g).to(torch.bfloat16)
    qkv[:, : hq * d] *= 2
    qkv[:, (hq + hk) * d :] *= 0.5
    q, k, v = ca.qkv_views(qkv, hq, hk, d)
    assert ca.bucket_tokens(t) == 3072  # padded: 72 rows past the sequence
    o8, descale = ca.dense_attention_fp8(q, k, v, d**-0.5)
    got = o8.float() * descale
    rows = slice(t - 300, t)  # the emulation's [Hq, T, T] scores for the last rows only
    y, o_scale = cast_e4m3_ref(qkv, (hq + hk) * d, ca.O_MARGIN)
    q8, k8, v8 = ca.qkv_views(y, hq, hk, d)
    emu = ca.causal_attention_fp8_ref(q8, k8, v8, d**-0.5, o_scale).float().view(t, hq * d) / o_scale
    exact = torch.nn.functional.scaled_dot_product_attention(
        *(x.float().transpose(0, 1)[None] for x in (q8, k8, v8)), is_causal=True, enable_gqa=True)[0]
    exact = exact.transpose(0, 1).reshape(t, hq * d)
    nocausal = torch.nn.functional.scaled_dot_product_attention(
        *(x.float().transpose(0, 1)[None] for x in (q8, k8, v8)), enable_gqa=True)[0].transpose(0, 1).reshape(t, hq * d)

    def rel(a, b):
        return float((a[rows] - b[rows]).norm() / b[rows].norm())

    result = {"vs_emulation": rel(got, emu), "vs_exact": rel(got, exact), "emulation_vs_exact": rel(emu, exact),
              "no_mask_vs_exact": rel(nocausal, exact)}
    measured("fp8_attention_vs_emulation", result)
    # on an H100 at 7f2339e: 0.031 from exact over the same e4m3 q/k/v, the emulation 0.032, the two 0.028
    # apart (cuDNN rounds P after its running max, the emulation after the row's: the same size of error,
    # not the same roundings); attention without the mask 0.22 away. A 5% error in O's scale would be ~0.06
    assert result["vs_exact"] < 1.5 * result["emulation_vs_exact"], result
    assert result["vs_emulation"] < 0.05 and result["no_mask_vs_exact"] > 0.15, result
    o8u, descale_u = ca.dense_attention_fp8(q[:2048], k[:2048], v[:2048], d**-0.5)  # 2048: its own graph
    o8p, descale_p = ca.dense_attention_fp8(q[:2100], k[:2100], v[:2100], d**-0.5)  # padded to 2304
    assert ca.bucket_tokens(2100) == 2304
    assert torch.isfinite(got).all() and torch.isfinite(o8p.float()).all()
    # the two share rows 0..2047 (causal); each has O's scale from its own V, so e4m3 roundings differ
    a, b = o8p[:2048].float() * descale_p[:1], o8u.float() * descale_u[:1]
    assert float((a - b).norm() / b.norm()) < 0.05


@pytest.fixture(scope="module")
def llama_d64_dir(tmp_path_factory):
    """A tiny random Llama with 64-dim heads (cuDNN's FP8 attention takes 64 and 128, not the usual 16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from tests.workers.engine.conftest import COMMON, _save

    torch.manual_seed(5)
    cfg = LlamaConfig(**{**COMMON, "hidden_size": 256, "intermediate_size": 512}, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("llama_d64"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp8_attention_in_the_engine(llama_d64_dir):
    """FP8 + fp8 KV, every prompt alone and uncached (the dense path: eager, and replayed as dense graphs),
    its attention on FP8 tensor cores or in bf16: teacher-forced log-probabilities against fp32 transformers.
    FP8 attention adds its error to FP8's, measured here; it runs (the op is bound, the dense steps ran)."""
    from kernels import cudnn_attention as ca

    why = ca.available("cuda")
    if why is not None:
        pytest.skip(why)
    llama_dir = llama_d64_dir
    prompts = prompt_set(6, seed=12, min_len=40, max_len=200)
    seqs = [p + c for p, c in zip(prompts, hf_greedy_cuda(llama_dir, prompts))]
    rows = scored_rows(hf_log_softmax(llama_dir, seqs))
    errs, calls = {}, {}
    for fp8_attention in (True, False):
        eng = LLMEngine(str(llama_dir), EngineConfig(
            device="cuda", kernel_backend="triton", num_blocks=256, max_model_len=512, dtype="bfloat16",
            quantization="fp8", kv_cache_dtype="fp8", fp8_attention=fp8_attention, dense_prefill_min_tokens=32,
            max_num_seqs=1))
        attn = eng.runner.model.layers[0].self_attn.attn
        assert (attn.dense_fp8 is not None) == fp8_attention
        calls[fp8_attention] = 0
        if fp8_attention:  # count the first layer's FP8 attention calls (the rope + cast launch's: the default)
            assert attn.dense_fp8_rope is not None
            op = attn.dense_fp8_rope

            def counted(*args, _op=op):
                calls[True] += 1
                return _op(*args)

            attn.dense_fp8_rope = counted
        # prompt log-probabilities: each prompt's one step runs eagerly (a graph samples its last row only)
        done = run_prompts(eng, seqs, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=20))
        eng.close()
        errs[fp8_attention] = score_error(rows, [lp for f in done for lp in f.prompt_logprobs[1:]])
    measured("fp8_attention_in_engine", {"fp8_attention": errs[True], "bf16_attention": errs[False], "calls": calls})
    assert calls[True] == len(seqs), calls  # every prompt's dense step, in FP8
    # FP8 GEMMs on this random 64-dim model are already far from fp32 (0.89 nats mean over the top 20,
    # top-1 0.58, H100 at 723a5c0); FP8 attention added 18% to that (1.05, top-1 0.55)
    assert errs[True]["mean_dlp_top"] < 1.5 * errs[False]["mean_dlp_top"], errs
    assert errs[True]["top1_agreement"] >= 0.85 * errs[False]["top1_agreement"], errs


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("slots", ["prompt", "decode"])
def test_cuda_rope_cache_cast_matches_rope_then_cast(slots):
    """Llama-3.1-8B's heads, an fp8 cache of 64-token blocks with V's keys innermost (the FP8 engine's):
    rope_cache_cast (FP8 attention's one launch, FIRSTTOKEN_FP8_ATTENTION_ROPE) gives rope_and_cache then
    cast_e4m3's e4m3 rows, V scale and cache to the bit, q and k left as they were (with write_qk, rotated to
    rope_and_cache's bits), a prompt's consecutive slots (from mid-block) and scattered ones alike. The same
    float ops in the same order: any difference is a defect."""
    from kernels.cudnn_attention import O_MARGIN, qkv_views
    from kernels.fp8_quant import cast_e4m3_triton
    from kernels.kv_layout import empty_kv_caches
    from kernels.rope_cache import rope_and_cache_triton, rope_cache_cast_triton

    hq, hk, d, bs, t = 32, 8, 128, 64, 3000
    g = torch.Generator(device="cuda").manual_seed(0)
    qkv0 = torch.randn((t, (hq + 2 * hk) * d), device="cuda", generator=g).to(torch.bfloat16) * 3
    qkv0[5, -1] = float("nan")  # a NaN in V: 0 in a keys-inner cache, NaN in the cast rows, not in the scale
    nb = t + 8
    blocks = torch.randperm(nb, device="cuda", generator=g)
    j = torch.arange(t, device="cuda")
    if slots == "prompt":
        slot = blocks[(j + 37) // bs] * bs + (j + 37) % bs
        pos = j + 37
    else:
        slot = blocks[j] * bs + torch.randint(0, bs, (t,), device="cuda", generator=g)
        pos = torch.randint(0, 8000, (t,), device="cuda", generator=g)
    slot[7] = -1  # padding: writes nothing
    inv = 1.0 / 500000.0 ** (torch.arange(0, d, 2, device="cuda") / d)
    ang = torch.arange(8192, device="cuda")[:, None] * inv[None, :]
    cs = torch.cat((ang.cos(), ang.sin()), dim=1).float().contiguous()

    def fresh():
        kc, vc = empty_kv_caches(nb, bs, hk, d, torch.float8_e4m3fn, "cuda", v_layout="keys_inner")
        return qkv0.clone(), kc, vc

    def same(a, b):
        return torch.equal(a.view(torch.uint8), b.view(torch.uint8))

    want = fresh()
    rope_and_cache_triton(*qkv_views(want[0], hq, hk, d), pos, cs, want[1], want[2], slot)
    y_want, s_want = cast_e4m3_triton(want[0], (hq + hk) * d, O_MARGIN)
    for tile in (32, 0):  # the default tiles, and one program a token (rope_and_cache's kernel with the cast)
        got = fresh()
        y, s = rope_cache_cast_triton(*qkv_views(got[0], hq, hk, d), pos, cs, got[1], got[2], slot, O_MARGIN,
                                      tile=tile)
        assert same(y, y_want) and torch.equal(s, s_want), tile
        assert same(got[0], qkv0) and same(got[1], want[1]) and same(got[2], want[2]), tile
    assert float(s) < 448.0 / (O_MARGIN * 3.0)  # from V's finite values (|v| ~ 3 sigma and more), NaN left out
    got = fresh()
    rope_cache_cast_triton(*qkv_views(got[0], hq, hk, d), pos, cs, got[1], got[2], slot, O_MARGIN, tile=64,
                           write_qk=True)
    assert [same(a, b) for a, b in zip(got, want)] == [True] * 3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_fp8_attention_rope_gives_the_two_launch_engines_outputs(llama_d64_dir, monkeypatch):
    """FP8 + fp8 KV with FP8 attention, prompts of 300-400 tokens alone (the dense path: replayed graphs for
    greedy tokens, eager steps for prompt log-probabilities): the one-launch rope + cache write + cast (the
    default) gives the tokens and prompt log-probabilities of rope_and_cache then the cast
    (FIRSTTOKEN_FP8_ATTENTION_ROPE=0) exactly (the same bits: the test above), and it ran."""
    from kernels import cudnn_attention as ca

    if ca.available("cuda") is not None:
        pytest.skip(ca.available("cuda"))
    prompts = prompt_set(4, seed=30, min_len=300, max_len=400)
    sp_graph = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    sp_eager = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=3)
    outs = {}
    for cast in ("0", "1"):
        monkeypatch.setenv("FIRSTTOKEN_FP8_ATTENTION_ROPE", cast)
        eng = LLMEngine(str(llama_d64_dir), EngineConfig(
            device="cuda", kernel_backend="triton", num_blocks=256, max_model_len=512, dtype="bfloat16",
            quantization="fp8", kv_cache_dtype="fp8", fp8_attention=True, dense_prefill_min_tokens=32,
            max_num_seqs=1))
        attn = eng.runner.model.layers[0].self_attn.attn
        assert (attn.dense_fp8_rope is not None) == (cast == "1")
        calls = []
        if cast == "1":
            op = attn.dense_fp8_rope

            def counted(*args, _op=op, _calls=calls):
                _calls.append(1)
                return _op(*args)

            attn.dense_fp8_rope = counted
        tokens = [f.output_token_ids for f in run_prompts(eng, prompts, sp_graph, tag="g")]
        logprobs = [f.prompt_logprobs[1:] for f in run_prompts(eng, prompts, sp_eager, tag="e")]
        eng.close()
        assert (len(calls) >= len(prompts)) == (cast == "1"), calls  # every eager prompt step, at least
        outs[cast] = (tokens, logprobs)
    assert outs["1"][0] == outs["0"][0]
    assert outs["1"][1] == outs["0"][1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_close_gives_the_memory_back():
    """An engine sized from free memory (KV cache, CUDA graphs), closed: its device memory goes
    back to the driver, and a second engine of the same configuration in the same process gets
    the same KV cache (before close() it ran out of memory: `del engine` freed nothing)."""
    import gc

    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    free0 = torch.cuda.mem_get_info()[0]
    alloc0 = torch.cuda.memory_allocated()
    cfg = {"device": "cuda", "dtype": "bfloat16", "kernel_backend": "triton", "max_model_len": 1024,
           "gpu_memory_utilization": 0.6, "quantization": "fp8"}
    sp = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    blocks, used = [], []
    for _ in range(2):
        with LLMEngine("tiny", EngineConfig(**cfg)) as eng:
            assert eng.runner.graphs is not None
            run_prompts(eng, prompt_set(4, vocab=eng.model_config.vocab_size), sp)
            blocks.append(eng.runner.num_blocks)
            used.append(free0 - torch.cuda.mem_get_info()[0])
        left = free0 - torch.cuda.mem_get_info()[0]
        held = torch.cuda.memory_allocated() - alloc0
        measured("close", {"kv_blocks": blocks[-1], "used_gib": used[-1] / 2**30, "left_after_close_mib": left / 2**20,
                           "allocated_after_close_mib": held / 2**20})
        assert used[-1] > 0.4 * free0  # the engine took most of the card
        # every tensor of the engine is gone; torch keeps cuBLAS's workspace (32 MiB on sm90) for
        # each stream cuBLAS ran on, the graph-capture stream's too: torch's state, not the engine's
        # (33 MiB held at 4902abe)
        assert held < 40 << 20, held
        assert left < 512 << 20, left  # and the memory is the driver's again (CUDA/cuBLAS/Triton state aside)
    assert blocks[1] >= 0.99 * blocks[0], blocks


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_step_device_seconds_under_async_scheduling():
    """Each launched step's CUDA-event time (what the SLO cost model should learn from): positive,
    and all of them together within the wall time of the run that launched them; the engine's
    running total (EngineStats.device_seconds) is the sum over the steps read back: all of them, or
    all but the last when a step launched past the requests' last tokens is never read."""
    import time

    eng = LLMEngine("tiny", EngineConfig(device="cuda", dtype="bfloat16", kernel_backend="triton", num_blocks=512,
                                         max_model_len=1024))
    assert eng.async_scheduling
    launched = []
    execute = eng.runner.execute

    def spy(out, prev=None, guide=None):
        launched.append(execute(out, prev, guide))
        return launched[-1]

    eng.runner.execute = spy
    t0 = time.perf_counter()
    run_prompts(eng, prompt_set(8, vocab=eng.model_config.vocab_size, max_len=300),
                SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    wall = time.perf_counter() - t0
    secs = [s.device_seconds() for s in launched]
    total = eng.stats().device_seconds
    eng.close()
    assert len(secs) >= 24 and all(s is not None and s > 0 for s in secs), secs  # a prefill step, 23 decodes
    assert sum(secs) <= wall, (sum(secs), wall)
    assert total == pytest.approx(sum(secs), rel=1e-6) or total == pytest.approx(sum(secs[:-1]), rel=1e-6), (
        total, sum(secs), secs[-1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_guided_decoding_under_graphs_and_async_scheduling(llama_dir):
    """Guided rows beside unguided ones on CUDA with decode graphs and async scheduling (each
    guided mask waits for the step before, read back while this step's forward runs; the masks
    copied from pinned buffers): every guided output is in its language, the tokens equal
    synchronous steps', and the unguided rows equal their runs without guided rows beside them."""
    from tests.workers.engine.test_guided_engine import GUIDES

    prompts = prompt_set(12, seed=9)
    plain = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)

    def go(async_scheduling: bool, with_guided: bool) -> dict:
        eng = LLMEngine(str(llama_dir), EngineConfig(device="cuda", dtype="float32", kernel_backend="triton",
                                                     num_blocks=256, max_model_len=512,
                                                     async_scheduling=async_scheduling))
        assert eng.runner.graphs is not None
        for i, p in enumerate(prompts):
            if i % 2 == 0:
                eng.add_request(f"p{i}", prompt_token_ids=p, sampling=plain)
            elif with_guided:
                g = GUIDES[i % len(GUIDES)]
                eng.add_request(f"g{i}", prompt_token_ids=p, sampling=SamplingParams(
                    max_tokens=60, temperature=1.0, seed=i, guided=g[0]))
        done = {}
        while eng.has_unfinished():
            for f in eng.step().finished:
                done[f.request_id] = f
        return done

    asyn, sync, alone = go(True, True), go(False, True), go(True, False)
    for rid, f in asyn.items():
        if rid.startswith("g"):
            ok = GUIDES[int(rid[1:]) % len(GUIDES)][1]
            assert f.finish_reason == "stop" and ok(f.text), (rid, f.text)
    assert {k: f.output_token_ids for k, f in asyn.items()} == {k: f.output_token_ids for k, f in sync.items()}
    assert {k: f.output_token_ids for k, f in asyn.items() if k.startswith("p")} == {
        k: f.output_token_ids for k, f in alone.items()}
