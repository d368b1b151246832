"""Calibrated per-channel FP8 weights, for bench_fp8_quality.py's `--calibrate` (an experiment: what
zero-cost calibration could buy the W8A8 the engine serves, whose kernels and scales stay as they are).

- GPTQ (Frantar et al. 2022) on the e4m3 grid: each row keeps the engine's searched scale; the columns are
  rounded one at a time (largest Hessian diagonal first) and each rounding error is spread over the
  columns not yet rounded, weighted by the inverse of H = X^T X of the layer's calibration inputs.
- SmoothQuant (Xiao et al. 2022): each input channel j of a projection is divided by
  s_j = amax(X_j)^a / amax(W_j)^(1-a) where its input is made (the RMSNorm's weight, or up_proj's row j
  for down_proj) and multiplied into the weight's column j, so that the activations' outliers move
  into the weights before both are quantized.

The calibration text is the repository's README and docs (never the corpus the bench scores).
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.fp8_linear import FP8, FP8_MAX

ROOT = Path(__file__).resolve().parents[1]


def calibration_documents(tok, tokens: int, seqlen: int = 512) -> list[list[int]]:
    """About `tokens` token ids in documents of `seqlen`, spread over README.md and docs/*.md."""
    files = [ROOT / "README.md"] + sorted((ROOT / "docs").glob("*.md"))
    ids: list[int] = []
    for f in files:
        if f.exists():
            ids += tok(f.read_text(errors="ignore")).input_ids
    docs = [ids[i:i + seqlen] for i in range(0, len(ids), seqlen)]
    step = max(1, len(docs) * seqlen // max(tokens, 1))
    out, n = [], 0
    for d in docs[::step]:
        if n >= tokens:
            break
        out.append(d)
        n += len(d)
    return out


def input_statistics(model: torch.nn.Module, names: set[str], docs: list[torch.Tensor]) -> tuple[dict, dict]:
    """For each nn.Linear named in `names`: H = sum of x^T x over its calibration inputs (fp64) and
    each input channel's largest magnitude."""
    hess: dict[str, torch.Tensor] = {}
    amax: dict[str, torch.Tensor] = {}
    hooks = []
    for name, mod in model.named_modules():
        if name in names:
            def hook(_m, inp, name=name):
                x = inp[0].detach().reshape(-1, inp[0].shape[-1]).double()
                hess[name] = hess[name] + x.t() @ x if name in hess else x.t() @ x
                a = x.abs().amax(0)
                amax[name] = torch.maximum(amax[name], a) if name in amax else a
            hooks.append(mod.register_forward_pre_hook(hook))
    try:
        with torch.no_grad():
            for ids in docs:
                model(ids.unsqueeze(0))
    finally:
        for h in hooks:
            h.remove()
    return hess, amax


def _round(col: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """A column [N] of weights rounded to each row's e4m3 grid (scale [N]), in the weights' units."""
    return (col / scale).clamp(-FP8_MAX, FP8_MAX).float().to(FP8).double() * scale


def gptq_fp8(w: torch.Tensor, hess: torch.Tensor, scale: torch.Tensor, damp: float = 0.01,
             block: int = 128) -> torch.Tensor:
    """w [N, K] (any float), hess [K, K], scale [N, 1] (each row's) -> q [N, K] e4m3 with the same scales,
    rounded column by column with the error feedback above. damp: the fraction of the mean diagonal
    added to H's diagonal (H is singular where inputs are correlated)."""
    w = w.detach().double().clone()
    n, k = w.shape
    s = scale.detach().double().reshape(-1)
    h = hess.detach().double().clone()
    dead = torch.diag(h) == 0  # inputs never seen: their columns are rounded as they are
    h[dead, dead] = 1.0
    perm = torch.argsort(torch.diag(h), descending=True)
    w, h = w[:, perm], h[perm][:, perm]
    h += damp * torch.diag(h).mean() * torch.eye(k, dtype=h.dtype, device=h.device)
    # the upper Cholesky factor of H^-1: row j holds the updates of rounding column j
    hinv = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)
    q = torch.empty_like(w)
    for b0 in range(0, k, block):
        b1 = min(b0 + block, k)
        wb, err = w[:, b0:b1].clone(), torch.empty((n, b1 - b0), dtype=w.dtype, device=w.device)
        hb = hinv[b0:b1, b0:b1]
        for j in range(b1 - b0):
            qc = _round(wb[:, j], s)
            q[:, b0 + j] = qc
            e = (wb[:, j] - qc) / hb[j, j]
            wb[:, j:] -= e.unsqueeze(1) * hb[j, j:].unsqueeze(0)
            err[:, j] = e
        w[:, b1:] -= err @ hinv[b0:b1, b1:]
    q = q[:, torch.argsort(perm)]
    return (q / s.unsqueeze(1)).clamp(-FP8_MAX, FP8_MAX).float().to(FP8)


SMOOTH_GROUPS = (  # (where the input is made, the projections that read it), per decoder layer
    ("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
    ("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj")),
    ("mlp.up_proj", ("mlp.down_proj",)),
)


@torch.no_grad()
def smooth(model: torch.nn.Module, amax: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """SmoothQuant's migration on a Llama model in place, from the inputs' amax (names as the model's
    modules); returns each smoothed projection's factors s (its input is now x / s)."""
    mods = dict(model.named_modules())
    factors = {}
    for i in range(len(model.model.layers)):
        pre = f"model.layers.{i}."
        for src, projs in SMOOTH_GROUPS:
            a = amax[pre + projs[0]].float()
            wmax = torch.stack([mods[pre + p].weight.float().abs().amax(0) for p in projs]).amax(0)
            s = (a.clamp(min=1e-5) ** alpha / wmax.clamp(min=1e-5) ** (1 - alpha)).clamp(min=1e-5)
            for p in projs:
                weight = mods[pre + p].weight
                weight.copy_((weight.float() * s).to(weight.dtype))
                factors[pre + p] = s
            weight = mods[pre + src].weight  # a norm's [K] or up_proj's [K, hidden]: its output j / s_j
            weight.copy_((weight.float() / (s if weight.dim() == 1 else s.unsqueeze(1))).to(weight.dtype))
    return factors
