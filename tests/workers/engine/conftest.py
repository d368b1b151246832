"""Tiny random Hugging Face checkpoints (saved with save_pretrained) and engine factories."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention keeps the KV cache in fixed-size blocks.",
    "Continuous batching admits new requests at every step of the engine.",
    "Kafka partitions carry jobs; Postgres keeps the results and their timings.",
    "def fibonacci(n): return n if n < 2 else fibonacci(n - 1) + fibonacci(n - 2)",
    "Once upon a time, in a land far away, there lived a small language model.",
] * 20


def make_tokenizer(path: Path, vocab_size: int = 384) -> None:
    """Train a small byte-level BPE with the `tokenizers` library and save tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(CORPUS, trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", bos)])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))


def _save(model, path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path)
    return path


COMMON = dict(
    vocab_size=384,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=0,
    eos_token_id=1,
    initializer_range=0.2,
)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(**COMMON, tie_word_embeddings=False)
    return _save(LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("llama"))


@pytest.fixture(scope="session")
def llama3_dir(tmp_path_factory) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1)
    rope = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32, "rope_theta": 500000.0}
    cfg = LlamaConfig(**{**COMMON, "num_key_value_heads": 1}, rope_scaling=rope)
    return _save(LlamaForCausalLM(cfg).eval(), tmp_path_factory.mktemp("llama3"))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(2)
    cfg = Qwen2Config(**{**COMMON, "num_key_value_heads": 4}, tie_word_embeddings=True)
    model = Qwen2ForCausalLM(cfg).eval()
    with torch.no_grad():  # make the q/k/v biases matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    return _save(model, tmp_path_factory.mktemp("qwen2"))


@pytest.fixture(scope="session")
def mistral_dir(tmp_path_factory) -> Path:
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(3)
    cfg = MistralConfig(**COMMON, sliding_window=8)
    return _save(MistralForCausalLM(cfg).eval(), tmp_path_factory.mktemp("mistral"))


def hf_greedy(path: Path, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """Hugging Face transformers' greedy continuation of each prompt, alone, in fp32."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32, attn_implementation="eager")
    model.eval()
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p])
            g = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                eos_token_id=None, pad_token_id=0,
            )
            outs.append(g[0, len(p):].tolist())
    return outs


def prompt_set(n: int = 8, vocab: int = 384, seed: int = 0, min_len: int = 3, max_len: int = 70) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.linspace(min_len, max_len, n).long().tolist()
    return [torch.randint(2, vocab, (ln,), generator=g).tolist() for ln in lens]


def run_prompts(engine, prompts: list[list[int]], sampling, tag: str = "r") -> list:
    """Add every prompt as request `{tag}{i}`, step the engine until all finish, and return the
    FinishedRequest of each, in prompt order."""
    for i, p in enumerate(prompts):
        engine.add_request(f"{tag}{i}", prompt_token_ids=p, sampling=sampling)
    done = {}
    while engine.has_unfinished():
        for f in engine.step().finished:
            done[f.request_id] = f
    return [done[f"{tag}{i}"] for i in range(len(prompts))]
