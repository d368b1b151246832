"""RMSNorm (+ residual) and SiLU-and-mul kernels against their references."""

from __future__ import annotations

import pytest
import torch
from kernel_testutil import TOL

from kernels.rmsnorm import rms_norm_ref, rms_norm_triton
from kernels.silu_mul import silu_and_mul_ref, silu_and_mul_triton

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "h"), [(1, 64), (6, 130), (42, 512), (123, 4096)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm(dtype: torch.dtype, t: int, h: int, with_residual: bool) -> None:
    # x: [T, H], a strided view (row stride > H) as the engine's slices can be
    x = (torch.randn(t, h + 8) * 3).to(dtype)[:, :h]
    res = torch.randn(t, h).to(dtype) if with_residual else None
    w = (1 + 0.5 * torch.randn(h)).to(dtype)
    out, new_res = rms_norm_triton(x, w, 1e-6, res)
    ref_out, ref_res = rms_norm_ref(x, w, 1e-6, res)
    assert not out.isnan().any() and not new_res.isnan().any()
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    torch.testing.assert_close(new_res, ref_res, **TOL[dtype])
    if not with_residual:
        assert new_res is x


def test_rms_norm_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="weight"):
        rms_norm_triton(torch.randn(4, 8), torch.randn(7), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        rms_norm_triton(torch.randn(4, 8), torch.randn(8), 1e-6, torch.randn(4, 9))


@pytest.mark.usefixtures("poison_empty")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("t", "inter"), [(1, 64), (6, 300), (42, 1408), (123, 96)])
def test_silu_and_mul(dtype: torch.dtype, t: int, inter: int) -> None:
    x = (torch.randn(t, 2 * inter) * 2).to(dtype)
    out = silu_and_mul_triton(x)
    assert out.shape == (t, inter) and not out.isnan().any()
    torch.testing.assert_close(out, silu_and_mul_ref(x), **TOL[dtype])


def test_silu_and_mul_catches_swapped_halves() -> None:
    # negative check: a kernel that swapped gate and up would fail the tolerance above
    x = torch.randn(6, 128)
    swapped = silu_and_mul_ref(torch.cat((x[:, 64:], x[:, :64]), dim=1))
    assert not torch.allclose(silu_and_mul_triton(x), swapped, **TOL[torch.float32])
