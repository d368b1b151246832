"""A large pure decode step as two halves (FIRSTTOKEN_DECODE_OVERLAP, LlamaForCausalLM._forward_halves): on
a GPU the halves run on two streams, one half's attention beside the other's GEMMs; on a CPU one after the
other. Either way each half computes what the whole step computes for its sequences."""

from __future__ import annotations

import pytest
import torch

from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import hf_greedy, prompt_set, run_prompts
from workers.engine import EngineConfig, LLMEngine
from workers.engine.attention import split_decode
from workers.engine.models.llama import LlamaForCausalLM

MAX_NEW = 8


def _engine(path, monkeypatch, overlap: str) -> LLMEngine:
    monkeypatch.setenv("FIRSTTOKEN_DECODE_OVERLAP", overlap)  # read when the model is built
    return LLMEngine(str(path), EngineConfig(device="cpu", dtype="float32", block_size=4))


def _count_halves(monkeypatch) -> list[int]:
    """Batch sizes that ran as two halves (a spy: the test fails if the path never runs)."""
    seen: list[int] = []
    real = LlamaForCausalLM._forward_halves

    def spy(self, x, *a, **k):
        seen.append(x.shape[0])
        return real(self, x, *a, **k)

    monkeypatch.setattr(LlamaForCausalLM, "_forward_halves", spy)
    return seen


@pytest.mark.parametrize("overlap", ["3", "3:free"])
def test_halved_decode_steps_give_transformers_greedy_tokens(llama_dir, monkeypatch, overlap):
    prompts = prompt_set(7, seed=11, min_len=3, max_len=40)
    want = hf_greedy(llama_dir, prompts, MAX_NEW)
    seen = _count_halves(monkeypatch)
    eng = _engine(llama_dir, monkeypatch, overlap)
    assert eng.runner.model.overlap_min_batch == 3
    assert eng.runner.model.overlap_serial_attention == (overlap == "3")
    sp = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True)
    got = [f.output_token_ids for f in run_prompts(eng, prompts, sp)]
    assert got == want
    assert seen and min(seen) >= 3 and max(seen) == len(prompts)  # decode steps of 3..7 sequences halved
    eng.close()


def test_off_by_default_and_below_the_batch(llama_dir, monkeypatch):
    seen = _count_halves(monkeypatch)
    monkeypatch.delenv("FIRSTTOKEN_DECODE_OVERLAP", raising=False)
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32", block_size=4))
    assert eng.runner.model.overlap_min_batch is None
    sp = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    run_prompts(eng, prompt_set(4, seed=2), sp)
    eng.close()
    eng = _engine(llama_dir, monkeypatch, "5")
    run_prompts(eng, prompt_set(4, seed=2), sp)  # decode steps of at most 4 sequences: never halved
    eng.close()
    assert seen == []


def test_split_decode_keeps_each_sequence_its_rows():
    from workers.engine.attention import AttentionMetadata

    b = 5
    meta = AttentionMetadata(slot_mapping=torch.arange(b) * 10, num_decodes=b, num_decode_tokens=b,
                             decode_block_tables=torch.arange(b * 3, dtype=torch.int32).view(b, 3),
                             decode_seq_lens=torch.arange(1, b + 1, dtype=torch.int32),
                             prefill_block_tables=None, prefill_query_start_loc=None, prefill_seq_lens=None,
                             decode_num_splits=2)
    a, c = split_decode(meta, 2)
    assert (a.num_decodes, a.num_decode_tokens, c.num_decodes, c.num_decode_tokens) == (2, 2, 3, 3)
    assert a.slot_mapping.tolist() == [0, 10] and c.slot_mapping.tolist() == [20, 30, 40]
    assert torch.equal(torch.cat([a.decode_block_tables, c.decode_block_tables]), meta.decode_block_tables)
    assert c.decode_seq_lens.tolist() == [3, 4, 5] and a.decode_num_splits == c.decode_num_splits == 2
    with pytest.raises(AssertionError):
        split_decode(meta, 0)
