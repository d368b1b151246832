"""Tolerances of the FP8 GEMM tests: both sides dequantize the same e4m3 values and accumulate in
fp32, so they differ by summation order only (fp32) or one rounding of the output (16-bit)."""

from __future__ import annotations

import torch


def tol(dtype: torch.dtype) -> dict[str, float]:
    return {
        torch.float32: {"atol": 1e-3, "rtol": 1e-4},
        torch.float16: {"atol": 2e-2, "rtol": 2e-3},
        torch.bfloat16: {"atol": 1e-1, "rtol": 1e-2},
    }[dtype]
