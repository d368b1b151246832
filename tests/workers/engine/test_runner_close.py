"""Closing an engine gives back what its runner holds (weights, KV cache, graphs): on a CPU, seen
through weak references to those tensors; the GPU side (memory back to the driver, a second
engine of the same size) is tests/workers/engine/test_gpu.py's."""

from __future__ import annotations

import gc
import weakref

from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import prompt_set, run_prompts
from workers.engine import EngineConfig, LLMEngine

SP = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


def _config(**kw) -> EngineConfig:
    return EngineConfig(device="cpu", num_blocks=64, max_model_len=256, **kw)


def _runner_tensors(runner) -> list:
    """Every tensor the runner owns: parameters, buffers, KV cache, RoPE tables."""
    tensors = [*runner.model.parameters(), *runner.model.buffers()]
    tensors += [t for kv in runner.kv_caches for t in kv]
    cs = runner.cos_sin
    tensors += list(cs) if isinstance(cs, tuple) else [cs]
    return tensors


def test_close_drops_every_tensor_and_a_second_engine_serves(llama_dir):
    prompts = prompt_set(3)
    eng = LLMEngine(str(llama_dir), _config())
    want = [f.output_token_ids for f in run_prompts(eng, prompts, SP)]
    refs = [weakref.ref(t) for t in _runner_tensors(eng.runner)]
    assert len(refs) > 10
    eng.close()
    eng.close()  # idempotent
    gc.collect()
    alive = [r for r in refs if r() is not None]
    assert not alive, f"{len(alive)} of {len(refs)} tensors outlived close()"
    assert eng.runner.closed and eng.runner.kv_caches == [] and eng.runner.model is None
    with LLMEngine(str(llama_dir), _config()) as again:  # the same model again, in the same process
        got = [f.output_token_ids for f in run_prompts(again, prompts, SP)]
        runner = again.runner
    assert runner.closed  # the context manager closed it
    assert got == want


def test_close_with_fp8_projections_drops_the_quantized_weights(llama_dir):
    eng = LLMEngine(str(llama_dir), _config(quantization="fp8"))
    run_prompts(eng, prompt_set(2), SP)
    fp8 = [b for name, b in eng.runner.model.named_buffers() if name.endswith("weight_fp8")]
    assert fp8
    refs = [weakref.ref(t) for t in fp8 + _runner_tensors(eng.runner)]
    del fp8
    eng.close()
    gc.collect()
    assert all(r() is None for r in refs)


def test_step_device_time_is_none_on_a_cpu(llama_dir):
    """SampledTokens.device_seconds() comes from CUDA events; a CPU step has none (the GPU side:
    tests/workers/engine/test_gpu.py)."""
    eng = LLMEngine(str(llama_dir), _config())
    launched = []
    execute = eng.runner.execute

    def spy(out, prev=None, guide=None):
        launched.append(execute(out, prev, guide))
        return launched[-1]

    eng.runner.execute = spy
    run_prompts(eng, prompt_set(2), SP)
    assert launched and all(s.device_seconds() is None for s in launched)
    eng.close()
