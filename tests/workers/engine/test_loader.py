"""Checkpoint loading: sharded checkpoints, and the errors of broken ones (`firsttoken generate`:
tests/firsttoken/test_cli_generate.py)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kernels.ops import get_ops
from schemas.sampling import SamplingParams
from tests.workers.engine.conftest import make_tokenizer, prompt_set
from workers.engine import LLM, EngineConfig
from workers.engine.config import ModelConfig
from workers.engine.errors import CheckpointError
from workers.engine.loader import load_checkpoint, resolve_dtype


@pytest.fixture(scope="module")
def sharded_dir(tmp_path_factory, llama_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32)
    out = tmp_path_factory.mktemp("sharded")
    model.save_pretrained(out, max_shard_size="100KB")
    make_tokenizer(out)
    return out


def test_sharded_checkpoint_loads_the_same_weights(llama_dir, sharded_dir):
    assert (sharded_dir / "model.safetensors.index.json").is_file()
    assert len(list(sharded_dir.glob("*.safetensors"))) > 1
    ops = get_ops("torch")
    a, _ = load_checkpoint(llama_dir, ops, torch.device("cpu"))
    b, _ = load_checkpoint(sharded_dir, ops, torch.device("cpu"))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k
    prompts = prompt_set(3, seed=2)
    sp = SamplingParams(max_tokens=5, temperature=0, ignore_eos=True)
    outs = [
        [o.output_token_ids for o in LLM(str(p), EngineConfig(device="cpu")).generate(prompts, sp)]
        for p in (llama_dir, sharded_dir)
    ]
    assert outs[0] == outs[1]


def test_checkpoint_errors(tmp_path, llama_dir):
    ops = get_ops("torch")
    cpu = torch.device("cpu")
    with pytest.raises(CheckpointError, match=r"no config\.json"):
        load_checkpoint(tmp_path, ops, cpu)
    d = tmp_path / "ck"
    shutil.copytree(llama_dir, d)
    for f in d.glob("*.safetensors"):
        f.unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors"):
        load_checkpoint(d, ops, cpu)
    cfg = json.loads((llama_dir / "config.json").read_text())
    with pytest.raises(CheckpointError, match="unsupported architecture"):
        ModelConfig.from_hf_dict({**cfg, "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2"})
    with pytest.raises(CheckpointError, match="unsupported rope scaling"):
        ModelConfig.from_hf_dict({**cfg, "rope_scaling": {"rope_type": "yarn", "factor": 4.0}})
    with pytest.raises(CheckpointError, match="unsupported dtype"):
        resolve_dtype("int8", cpu)
    # an index naming a shard that is not there
    e = tmp_path / "idx"
    shutil.copytree(llama_dir, e)
    (e / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": "missing.safetensors"}}))
    with pytest.raises(CheckpointError, match="missing shard"):
        load_checkpoint(e, ops, cpu)
    # a checkpoint without one of its tensors
    from safetensors.torch import load_file, save_file

    f = tmp_path / "partial"
    shutil.copytree(llama_dir, f)
    st = load_file(f / "model.safetensors")
    st.pop("model.layers.1.mlp.down_proj.weight")
    save_file(st, f / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match="lacks weights"):
        load_checkpoint(f, ops, cpu)
