"""FP8 (e4m3) W8A8 linear layers: weights quantized once per output channel, activations per
token at run time, the product accumulated in fp32.

The GEMMs take quantized activations (e4m3 and one scale per token, [T, 1]) and weights (e4m3 and
one scale per output channel, [N, 1]): `fp8_gemm_ref` is the reference (and the CPU path): it
dequantizes both operands and multiplies in fp32, which is what an FP8 tensor-core GEMM with fp32
accumulation computes, up to the order of the sums. `fp8_gemm_scaled_mm` runs it on the GPU with
`torch._scaled_mm` (sm89+); kernels/fp8_gemm.py has a Triton one for few rows. `fp8_linear`
quantizes the activations first, as a layer whose input comes unquantized does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448


def quantize_rowwise(x: torch.Tensor, eps: float = 1e-12) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [R, C] -> (q: [R, C] e4m3, scale: [R, 1] fp32), x ~= q * scale, each row scaled so that
    its largest magnitude maps to e4m3's largest value: a weight per output channel, an activation
    per token."""
    xf = x.detach().float()
    scale = xf.abs().amax(dim=1, keepdim=True).clamp(min=eps) / FP8_MAX  # [R, 1]
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`quantize_rowwise` at its default eps: what the layers and the fused ops' references run."""
    return quantize_rowwise(x)


# the weight scales quantize_weight tries per output channel: the row's amax x 1.00, 0.99, ..., 0.70
WEIGHT_SCALE_FRACTIONS = tuple(1.0 - i / 100 for i in range(31))


def quantize_weight(w: torch.Tensor, search: bool = True, chunk: int = 1 << 26) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] -> (q [N, K] e4m3, scale [N, 1] fp32), one scale per output channel: of the
    scales amax x f / 448 (f in WEIGHT_SCALE_FRACTIONS), the one whose rounding to e4m3 leaves the
    row's least squared error (values past f x amax clip to 448). A float format's error is where
    the row's values fall between its grid points, which the scale shifts; on SmolLM2 (W8A8 as
    served, 2410 positions) this took the mean KL against bf16 from 0.0278 to 0.0234 nats on the
    CPU, 0.0268 to 0.0242 on the H200 (bench/results/2026-12-03-fp8-quality-corpus.md). f = 1 is the first
    candidate and kept on ties, so no row is worse than `quantize_rowwise`'s. Run once, at load; in
    chunks of rows of about `chunk` elements (fp32 temporaries of ~256 MB). `search=False`: `quantize_rowwise`."""
    if not search:
        return quantize_rowwise(w)
    n, k = w.shape
    q = torch.empty((n, k), dtype=FP8, device=w.device)
    scale = torch.empty((n, 1), dtype=torch.float32, device=w.device)
    step = max(1, chunk // max(k, 1))
    for r0 in range(0, n, step):
        x = w[r0:r0 + step].detach().float()
        amax = x.abs().amax(dim=1, keepdim=True).clamp(min=1e-12)
        best_err = best_s = best_q = None
        for f in WEIGHT_SCALE_FRACTIONS:
            s = amax * f / FP8_MAX
            cand = (x / s).clamp_(-FP8_MAX, FP8_MAX).to(FP8)
            # each element's error in IEEE fp32 (the same on any device), summed in fp64 so that the
            # CPU's and a GPU's sum orders do not pick different scales for a row
            err = cand.float().mul_(s).sub_(x).square_().sum(dim=1, keepdim=True, dtype=torch.float64)
            if best_err is None:
                best_err, best_s, best_q = err, s, cand
                continue
            better = err < best_err
            best_err = torch.where(better, err, best_err)
            best_s = torch.where(better, s, best_s)
            best_q = torch.where(better, cand.view(torch.uint8), best_q.view(torch.uint8)).view(FP8)
        q[r0:r0 + step] = best_q
        scale[r0:r0 + step] = best_s
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(q [R, C] e4m3, scale [R, 1]) -> [R, C] fp32: each row times its scale."""
    return q.float() * scale.float().reshape(-1, 1)


Gemm = Callable[..., torch.Tensor]  # (x_q, x_scale, w_q, w_scale, bias, out_dtype) -> [T, N]


def fp8_gemm_ref(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """x_q: [T, K] e4m3, x_scale: [T, 1] (per token), w_q: [N, K] e4m3, w_scale: [N, 1] (per output
    channel) -> [T, N] in out_dtype: both dequantized, multiplied in fp32."""
    out = dequantize(x_q, x_scale) @ dequantize(w_q, w_scale).t()  # [T, N] fp32
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype)


# _scaled_mm's fast accumulation for weights of at most this many input columns (the engine's default;
# FIRSTTOKEN_FP8_FAST_ACCUM=0 turns it off, =1 on at every K). On the H200, Llama-3.1-8B shapes
# (bench/bench_fp8_accum.py, bench/results/2026-12-03-fp8-accum-h200-8132169.md): K = 4096 (qkv, o,
# gate_up) 1.07-1.16x faster at 2048 and 8192 rows, even at 128; its output error against the exact
# product of the same e4m3 inputs 0.16% RMS (fp32 accumulation: 0.02%), against the 3.6% that W8A8's
# input rounding itself costs there (so 3.64% in all). K = 14336 (down): no faster (0.99-1.03x) and
# twice the error (0.33%): left on fp32 accumulation.
FAST_ACCUM_MAX_K = 8192


def fp8_gemm_scaled_mm(
    x_q: torch.Tensor, x_scale: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor,
    bias: torch.Tensor | None = None, out_dtype: torch.dtype = torch.float32, fast_accum: bool = False,
) -> torch.Tensor:
    """The same on CUDA with torch._scaled_mm (FP8 tensor cores, fp32 accumulation). K and N must
    be multiples of 16; w_q.t() is column-major, as _scaled_mm wants its second operand.
    fast_accum: cuBLASLt's fast accumulation (the tensor cores' own accumulator over the whole K
    loop, not promoted to fp32 every few steps): faster, less exact (bench/bench_fp8_accum.py)."""
    return torch._scaled_mm(
        x_q, w_q.t(), scale_a=x_scale, scale_b=w_scale.t().contiguous(), bias=bias, out_dtype=out_dtype,
        use_fast_accum=fast_accum,
    )


def fp8_linear(
    gemm: Gemm, x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x: [T, K] (any float dtype) quantized per token, then `gemm` -> [T, N] in x's dtype."""
    x_q, x_scale = quantize(x)  # [T, K], [T, 1]
    return gemm(x_q, x_scale, w_q, w_scale, bias, x.dtype)


def fp8_linear_ref(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`fp8_linear` through the reference GEMM."""
    return fp8_linear(fp8_gemm_ref, x, w_q, w_scale, bias)


def fp8_linear_scaled_mm(
    x: torch.Tensor, w_q: torch.Tensor, w_scale: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """`fp8_linear` through torch._scaled_mm."""
    return fp8_linear(fp8_gemm_scaled_mm, x, w_q, w_scale, bias)


def scaled_mm_supported(device: torch.device, k: int, n: int) -> bool:
    """True when torch._scaled_mm can run these shapes here (CUDA sm89+, K and N multiples of 16)."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    major, minor = torch.cuda.get_device_capability(device)
    return (major, minor) >= (8, 9) and k % 16 == 0 and n % 16 == 0
