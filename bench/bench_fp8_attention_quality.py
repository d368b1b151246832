"""What FP8 attention (EngineConfig.fp8_attention) costs a real model: SmolLM2-135M-Instruct (64-dim heads,
which the FP8 path takes) through firsttoken's engine, each long document one dense prefill step (the path a
long uncached prompt takes), its attention in FP8 or in the model's dtype, every position's next-token
distribution against the bf16 engine's.

    python3 bench/bench_fp8_attention_quality.py [--device cpu|cuda] [--doc-tokens 1536]

On the CPU the FP8 attention is its PyTorch emulation (kernels.cudnn_attention.causal_attention_fp8_ref: e4m3
q/k/v/P/O as cuDNN's forward rounds them); on a GPU, cuDNN's. Documents: bench_fp8_quality.py's corpus
packed into documents of about --doc-tokens tokens. Prints JSON and a markdown table; writes them under $OUT.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_fp8_quality import compare, pack_corpus
from bench.common import header, md_table, write_report
from workers.engine import EngineConfig, LLMEngine
from workers.engine.attention import AttentionMetadata
from workers.engine.downloads import ensure_model


def dense_logprobs(eng: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Log-softmax at every position of one dense prefill step over ids: [T, V] fp32 on the CPU."""
    r = eng.runner
    t, bs = len(ids), r.block_size
    dev = r.device
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t, device=dev), num_decodes=0, num_decode_tokens=0, decode_block_tables=None,
        decode_seq_lens=None, prefill_block_tables=torch.arange(-(-t // bs), dtype=torch.int32, device=dev)[None],
        prefill_query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
        prefill_seq_lens=torch.tensor([t], dtype=torch.int32, device=dev), prefill_max_query_len=t,
        prefill_dense=True)
    with torch.inference_mode():
        hidden, residual = r.model(torch.tensor(ids, device=dev), torch.arange(t, device=dev), r.cos_sin,
                                   r.kv_caches, meta)
        return torch.log_softmax(r.model.compute_logits(hidden, residual), -1).cpu()


def emulated(round_kv: bool, round_q: str, round_p: bool):
    """Attention in fp32 with chosen e4m3 roundings (the dense op's signature, the model's dtype out):
    round_kv: k/v as the fp8 cache holds them; round_q: "" (none), "unit" (scale 1, as the FP8 path
    does) or "amax" (a per-tensor scale mapping max |q| to 448); round_p: P at P_SCALE."""
    from kernels.cudnn_attention import FP8, FP8_MAX, causal_attention_fp32, saturate_e4m3

    def op(q, k, v, scale):
        if round_q == "unit":
            q8 = saturate_e4m3(q).float()
        elif round_q == "amax":
            s = q.float().abs().amax().clamp_min(1e-12) / FP8_MAX
            q8 = (q.float() / s).to(FP8).float() * s
        else:
            q8 = q
        k8, v8 = (saturate_e4m3(x) if round_kv else x for x in (k, v))
        return causal_attention_fp32(q8, k8, v8, scale, round_p).to(q.dtype)

    return op


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--doc-tokens", type=int, default=1536)
    ap.add_argument("--decompose", action="store_true",
                    help="also the emulated roundings one by one (k/v as cached; + q; + P), O kept in the model's "
                         "dtype: where FP8 attention's error comes from")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    path = ensure_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(path))
    docs = pack_corpus(tok, args.doc_tokens)
    backend = "torch" if args.device == "cpu" else "triton"
    common = dict(device=args.device, dtype="bfloat16", kernel_backend=backend, block_size=16, cuda_graphs=False,
                  num_blocks=-(-max(map(len, docs)) // 16) + 8, max_model_len=max(map(len, docs)) + 16)
    bf16 = LLMEngine(str(path), EngineConfig(**common))
    fp8 = LLMEngine(str(path), EngineConfig(**common, quantization="fp8", kv_cache_dtype="fp8", fp8_attention=True))
    layers = [layer.self_attn.attn for layer in fp8.runner.model.layers]
    fp8_op = layers[0].dense_fp8
    assert fp8_op is not None, "FP8 attention is not on for this model"
    ops = {"bf16 attention": None, "FP8 attention": fp8_op}
    if args.decompose:
        ops |= {"emulated: k/v as cached": emulated(True, "", False),
                "emulated: k/v as cached, q scale 1": emulated(True, "unit", False),
                "emulated: k/v as cached, q per-tensor scale": emulated(True, "amax", False),
                "emulated: k/v as cached, q scale 1, P e4m3": emulated(True, "unit", True)}
    ref: list[torch.Tensor] = []
    got: dict[str, list[torch.Tensor]] = {name: [] for name in ops}
    for ids in docs:
        ref.append(dense_logprobs(bf16, ids))
        for name, op in ops.items():
            for a in layers:
                a.dense_fp8 = op  # None: the dense path's attention in the model's dtype (k/v as they are)
                a.dense_fp8_rope = None  # rope_and_cache, then op (the one-launch form gives the same bits)
            got[name].append(dense_logprobs(fp8, ids))
        print(f"# document of {len(ids)} tokens", flush=True)
    ref_t = torch.cat(ref)
    rows = [{"engine": f"FP8 projections, fp8 KV, {name}", **compare(ref_t, torch.cat(x), ties=True)} for name, x in got.items()]
    rows.append({"engine": "FP8 attention against bf16 attention (both FP8 projections)",
                 **compare(torch.cat(got["bf16 attention"]), torch.cat(got["FP8 attention"]), ties=True)})
    info = {**header(), "model": "smollm2-135m", "device": args.device, "documents": [len(d) for d in docs],
            "positions": int(ref_t.shape[0]), "fp8_attention": "emulation" if backend == "torch" else "cuDNN"}
    for r in rows:
        print(r, flush=True)
    write_report("fp8_attention_quality", {**info, "rows": rows}, md_table(rows, ["engine", "top1_agreement", "top1_stderr", "mean_kl", "p99_kl"]))


if __name__ == "__main__":
    main()
