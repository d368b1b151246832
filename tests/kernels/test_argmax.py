"""The one-launch row argmax (kernels/argmax.py) in the interpreter: torch.argmax's index on
awkward widths, ties inside a chunk and across chunks (the first wins), -inf rows, NaN."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import argmax_rows_triton


@pytest.mark.parametrize(("b", "v", "chunk"), [(1, 1, 16), (2, 100, 16), (3, 513, 64), (5, 4097, 1024)])
def test_argmax_rows_matches_torch(poison_empty, b, v, chunk):
    g = torch.Generator().manual_seed(b * v)
    x = torch.randn(b, v, generator=g)
    for _ in range(2):  # the counters are back at zero for the next launch
        assert torch.equal(argmax_rows_triton(x, chunk=chunk), x.argmax(-1))
    if v < 2 * chunk or b < 3:
        return
    top = x.max() + 1
    x[0, [chunk + 3, 5, v - 1]] = top  # a tie across chunks: the first index
    x[1, [chunk * 2 - 1, chunk * 2 - 2]] = top  # a tie inside one chunk
    x[-1] = float("-inf")  # nothing above -inf: index 0, as torch
    got = argmax_rows_triton(x, chunk=chunk)
    assert torch.equal(got, x.argmax(-1)), (got, x.argmax(-1))
    assert got[0] == 5 and got[1] == chunk * 2 - 2 and got[-1] == 0
    x[0, [chunk + 7, 9]] = float("nan")  # NaN ranks above every number: its first index
    assert argmax_rows_triton(x, chunk=chunk)[0] == x.argmax(-1)[0] == 9


def test_argmax_rows_half_precision_and_strided_rows(poison_empty):
    x = torch.randn(4, 300).to(torch.bfloat16)
    assert torch.equal(argmax_rows_triton(x, chunk=64), x.argmax(-1))
    wide = torch.randn(3, 500)
    view = wide[:, :300]  # rows 500 apart
    assert torch.equal(argmax_rows_triton(view, chunk=64), view.argmax(-1))
    with pytest.raises(ValueError):
        argmax_rows_triton(torch.randn(3, 8, 8))
