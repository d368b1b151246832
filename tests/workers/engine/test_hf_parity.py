"""Greedy tokens of the engine equal Hugging Face transformers' for the same checkpoint (fp32)."""

from __future__ import annotations

import pytest

from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import hf_greedy, prompt_set
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


@pytest.mark.parametrize("n_prompt", [67, 64, 150])
def test_choices_sharing_the_prompt_blocks_match_transformers(llama_dir, n_prompt):
    """n=4 sequences of one prompt (workers.choices): the three after the first are forked from its
    prefill (its full blocks shared, its partial last block copied after the step; none at 64)
    and each gives transformers' greedy tokens."""
    from workers.choices import ChoiceGroups
    from workers.engine import LLMEngine

    prompt = prompt_set(1, seed=11, min_len=n_prompt, max_len=n_prompt)[0]
    want = hf_greedy(llama_dir, [prompt], MAX_NEW)[0]
    engine = LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32", block_size=16))
    groups = ChoiceGroups(engine)
    groups.add("job", [prompt], [None], SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, n=4))
    done = []
    while engine.has_unfinished():
        done.extend(groups.finished(engine.step().finished))
    (f,) = done
    assert [c.output.usage.cached_prompt_tokens for c in f.choices] == [0, n_prompt, n_prompt, n_prompt]
    assert [c.output.output_token_ids for c in f.choices] == [want] * 4


def test_logprobs_match_transformers(llama_dir):
    """Each output token's log-probability and the top alternatives equal transformers'
    log-softmax of the same positions (teacher-forced over the engine's tokens), for greedy and
    sampled requests in one batch beside one that asked for none."""
    import torch
    from transformers import AutoModelForCausalLM

    from workers.engine import LLMEngine

    prompts = prompt_set(4)
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32"))
    greedy = SamplingParams(max_tokens=MAX_NEW, temperature=0.0, ignore_eos=True, logprobs=4)
    sampled = SamplingParams(max_tokens=MAX_NEW, temperature=1.3, top_k=20, seed=7, ignore_eos=True, logprobs=0)
    none = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    for i, (p, sp) in enumerate(zip(prompts, (greedy, greedy, sampled, none))):  # all in the same steps
        eng.add_request(f"r{i}", prompt_token_ids=p, sampling=sp)
    done = {}
    while eng.has_unfinished():
        for f in eng.step().finished:
            done[f.request_id] = f
    outs = [done[f"r{i}"] for i in range(4)]
    assert outs[3].logprobs is None
    model = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    for p, out, k in zip(prompts, outs[:3], (4, 4, 0)):
        assert out.logprobs is not None and len(out.logprobs) == len(out.output_token_ids) == MAX_NEW
        ids = torch.tensor([p + out.output_token_ids])
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, len(p) - 1 : -1].float(), dim=-1)  # [MAX_NEW, V]
        for i, (tok, got) in enumerate(zip(out.output_token_ids, out.logprobs)):
            assert got.token_id == tok
            assert got.logprob == pytest.approx(lp[i, tok].item(), abs=1e-4)  # the raw distribution's
            assert len(got.top) == k
            if k:
                want_lp, want_ids = lp[i].topk(k)
                assert [t for t, _ in got.top] == want_ids.tolist()
                assert [v for _, v in got.top] == pytest.approx(want_lp.tolist(), abs=1e-4)
                assert got.top[0][0] == tok  # greedy: the token is the most likely one


def test_prompt_logprobs_match_transformers(llama_dir):
    """Each prompt token's log-probability given the tokens before it (and the top alternatives)
    equal transformers' log-softmax over the prompt, with the prompt cut into several prefill
    chunks, beside other requests, and even when its prefix sits in the cache (it is computed
    again: cached positions have no logits)."""
    import torch
    from transformers import AutoModelForCausalLM

    from workers.engine import LLMEngine

    prompts = prompt_set(3, min_len=40, max_len=70)
    eng = LLMEngine(str(llama_dir), EngineConfig(device="cpu", dtype="float32", max_num_batched_tokens=24,
                                                 block_size=8))
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng.add_request("warm", prompt_token_ids=prompts[0], sampling=plain)  # puts prompt 0's blocks in the cache
    while eng.has_unfinished():
        eng.step()
    scored = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=3, logprobs=1)
    for i, p in enumerate(prompts):
        eng.add_request(f"p{i}", prompt_token_ids=p, sampling=scored if i != 1 else plain)
    done = {}
    while eng.has_unfinished():
        for f in eng.step().finished:
            done[f.request_id] = f
    assert done["p1"].prompt_logprobs is None
    assert done["p0"].usage.cached_prompt_tokens == 0  # scored: computed whole, though cached
    model = AutoModelForCausalLM.from_pretrained(llama_dir, torch_dtype=torch.float32, attn_implementation="eager").eval()
    for i in (0, 2):
        p, got = prompts[i], done[f"p{i}"].prompt_logprobs
        assert len(p) > 24 and got is not None and len(got) == len(p) and got[0] is None  # several chunks
        with torch.no_grad():
            lp = torch.log_softmax(model(torch.tensor([p])).logits[0].float(), dim=-1)  # [P, V]
        for pos in range(1, len(p)):
            g = got[pos]
            assert g.token_id == p[pos] and g.logprob == pytest.approx(lp[pos - 1, p[pos]].item(), abs=1e-4)
            want_lp, want_ids = lp[pos - 1].topk(3)
            assert [t for t, _ in g.top] == want_ids.tolist() and g.token_id in done[f"p{i}"].token_texts
            assert [v for _, v in g.top] == pytest.approx(want_lp.tolist(), abs=1e-4)
        assert len(done[f"p{i}"].logprobs) == 2  # the output's own, beside
