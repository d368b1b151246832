"""Load a Hugging Face checkpoint directory (or a random preset) into our fused Llama model."""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch

from kernels.ops import KernelOps
from workers.engine.config import ModelConfig
from workers.engine.errors import CheckpointError
from workers.engine.models.llama import LlamaForCausalLM

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def resolve_dtype(name: str | torch.dtype, device: torch.device) -> torch.dtype:
    """The torch dtype for `name`, refusing one the device cannot compute in."""
    if isinstance(name, torch.dtype):
        dtype = name
    else:
        key = name.removeprefix("torch.")
        if key not in DTYPES:
            raise CheckpointError(f"unsupported dtype {name!r}; supported: float32, bfloat16, float16")
        dtype = DTYPES[key]
    if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
        raise CheckpointError(f"{torch.cuda.get_device_name(device)} cannot compute in bfloat16; use float16")
    return dtype


def _empty_model(cfg: ModelConfig, ops: KernelOps, device: torch.device, dtype: torch.dtype) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, ops)
    return model.to_empty(device=device).to(dtype)


def random_model(cfg: ModelConfig, ops: KernelOps, device: torch.device, dtype: torch.dtype,
                 seed: int = 0) -> LlamaForCausalLM:
    """A model with random weights (normal, std 0.02; norms at 1), the same for the same seed and device."""
    model = _empty_model(cfg, ops, device, dtype)
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                p.fill_(1.0)
            elif name.endswith("bias"):
                p.zero_()
            else:
                p.normal_(0.0, 0.02, generator=gen)
    return model.eval()


_LAYER = re.compile(r"^model\.layers\.(\d+)\.(.+)$")
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", 0),
    "self_attn.k_proj": ("self_attn.qkv_proj", 1),
    "self_attn.v_proj": ("self_attn.qkv_proj", 2),
    "mlp.gate_proj": ("mlp.gate_up_proj", 0),
    "mlp.up_proj": ("mlp.gate_up_proj", 1),
}


def _target(cfg: ModelConfig, hf_name: str) -> tuple[str, int, int] | None:
    """Map a checkpoint tensor name to (our parameter, row offset, rows); None to skip it."""
    if hf_name == "model.embed_tokens.weight":
        return "embed_tokens.weight", 0, cfg.vocab_size
    if hf_name == "model.norm.weight":
        return "norm.weight", 0, cfg.hidden_size
    if hf_name == "lm_head.weight":
        return None if cfg.tie_word_embeddings else ("lm_head.weight", 0, cfg.vocab_size)
    m = _LAYER.match(hf_name)
    if not m:
        return None
    i, rest = m.group(1), m.group(2)
    if rest.endswith("rotary_emb.inv_freq"):
        return None
    mod, _, kind = rest.rpartition(".")
    if mod in _FUSED:
        fused, part = _FUSED[mod]
        if fused == "self_attn.qkv_proj":
            sizes = [cfg.q_size, cfg.kv_size, cfg.kv_size]
        else:
            sizes = [cfg.intermediate_size, cfg.intermediate_size]
        return f"layers.{i}.{fused}.{kind}", sum(sizes[:part]), sizes[part]
    return f"layers.{i}.{rest}", 0, -1


def checkpoint_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint directory (sharded through the index, or single)."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text()).get("weight_map", {})
        files = sorted({path / f for f in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: index names missing shard(s) {missing}")
        return files
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors weights (pytorch_model.bin is not supported)")
    return files


def load_checkpoint(path: str | Path, ops: KernelOps, device: torch.device,
                    dtype: torch.dtype | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load config and weights from a Hugging Face directory, fusing q/k/v and gate/up."""
    from safetensors import safe_open

    p = Path(path)
    if not p.is_dir():
        raise CheckpointError(f"{p}: not a directory")
    cfg = ModelConfig.from_dir(p)
    dtype = dtype or resolve_dtype(cfg.dtype, device)
    files = checkpoint_files(p)
    model = _empty_model(cfg, ops, device, dtype)
    params = dict(model.named_parameters())
    filled: dict[str, int] = {}
    with torch.no_grad():
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as sf:
                for name in sf.keys():  # noqa: SIM118 (safe_open is not a dict)
                    tgt = _target(cfg, name)
                    if tgt is None:
                        continue
                    pname, off, rows = tgt
                    if pname not in params:
                        raise CheckpointError(f"{f.name}: unexpected tensor {name!r}")
                    dst = params[pname]
                    t = sf.get_tensor(name)
                    part = dst if rows == -1 else dst[off : off + rows]
                    if tuple(t.shape) != tuple(part.shape):
                        raise CheckpointError(
                            f"{f.name}: {name} has shape {tuple(t.shape)}, expected {tuple(part.shape)}"
                        )
                    part.copy_(t.to(dtype))
                    filled[pname] = filled.get(pname, 0) + t.shape[0]
    missing = [n for n, prm in params.items() if filled.get(n, 0) != prm.shape[0]]
    if missing:
        raise CheckpointError(f"{p}: checkpoint lacks weights for {missing[:5]}{'...' if len(missing) > 5 else ''}")
    return model.eval(), cfg
