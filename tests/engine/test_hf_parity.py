"""Greedy tokens of the engine equal Hugging Face transformers' for the same checkpoint (fp32)."""

from __future__ import annotations

import pytest

from schemas.sampling import SamplingParams
from tests.engine.conftest import hf_greedy, prompt_set
from workers.engine import LLM, EngineConfig

MAX_NEW = 12


def run_engine(path, prompts, **cfg):
    llm = LLM(str(path), EngineConfig(device="cpu", dtype="float32", **cfg))
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    return llm, [o.output_token_ids for o in llm.generate(prompts, sp)]


@pytest.mark.parametrize("ckpt", ["llama_dir", "llama3_dir", "qwen2_dir", "mistral_dir"])
def test_greedy_matches_transformers(ckpt, request):
    path = request.getfixturevalue(ckpt)
    prompts = prompt_set(8)
    want = hf_greedy(path, prompts, MAX_NEW)
    _, got = run_engine(path, prompts)
    assert got == want
