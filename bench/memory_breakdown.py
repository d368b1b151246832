"""What an engine holds on the GPU once started: memory allocated, by the code of ours that
allocated it (torch's allocator history from before the engine is built), against the KV cache
and the budget gpu_memory_utilization gives.

    python3 bench/memory_breakdown.py --quantization fp8 --kv-cache-dtype fp8 --max-num-seqs 1024
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from workers.engine import EngineConfig, LLMEngine

OURS = ("/workers/", "/kernels/", "/bench/")


def where(frames: list[dict], depth: int) -> str:
    """The innermost `depth` frames of this project's code."""
    ours = [f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames
            if any(p in f["filename"] for p in OURS)]
    return " < ".join(ours[:depth]) or "(no frame of ours)"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--max-num-seqs", type=int, default=1024)
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.90)
    ap.add_argument("--depth", type=int, default=3, help="frames of ours that name an allocation site")
    ap.add_argument("--rows", type=int, default=25)
    args = ap.parse_args()
    torch.cuda.memory._record_memory_history(max_entries=200000)
    cfg = EngineConfig(max_model_len=2304, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.gpu_memory_utilization,
                       quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    eng = LLMEngine(args.preset, cfg)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    sites: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for seg in snap["segments"]:
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                s = sites[where(b.get("frames", []), args.depth)]
                s[0] += b["size"]
                s[1] += 1
    total = torch.cuda.mem_get_info()[1]
    kv = eng.stats().kv_blocks_total * eng.runner.kv_bytes_per_block()
    gib = 2**30
    print(f"device {total / gib:.2f} GiB; budget x {args.gpu_memory_utilization}: "
          f"{total * args.gpu_memory_utilization / gib:.2f} GiB; allocated {torch.cuda.memory_allocated() / gib:.2f}, "
          f"reserved {torch.cuda.memory_reserved() / gib:.2f}; KV cache {kv / gib:.2f} GiB")
    print("| GiB | blocks | allocated at |\n|---|---|---|")
    for site, (size, n) in sorted(sites.items(), key=lambda kv_: -kv_[1][0])[: args.rows]:
        print(f"| {size / gib:.3f} | {n} | {site} |")


if __name__ == "__main__":
    main()
