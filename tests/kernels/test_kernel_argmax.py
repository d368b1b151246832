"""The two-launch row argmax (greedy sampling) against torch.argmax: ties, NaN, -inf, awkward widths."""

from __future__ import annotations

import pytest
import torch

from kernels.argmax import argmax_triton


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("rows", "v", "chunk"), [(1, 1, 16), (1, 17, 16), (3, 1000, 64), (5, 4099, 256),
                                                  (2, 49152, 2048), (7, 50257, 2048)])
def test_argmax_matches_torch(dtype: torch.dtype, rows: int, v: int, chunk: int, poison_empty) -> None:
    x = torch.randn(rows, v).to(dtype)
    assert torch.equal(argmax_triton(x, chunk=chunk), x.argmax(dim=-1))


def test_argmax_ties_take_the_first_index_across_and_within_chunks() -> None:
    x = torch.zeros(4, 300)
    x[0, [5, 6, 290]] = 3.0  # within the first chunk, and again in the last
    x[1, [70, 140, 299]] = 2.0  # the first in the second chunk
    x[2, [299]] = 1.0  # the very last column
    x[3] = 7.0  # all equal: index 0
    got = argmax_triton(x, chunk=64)
    assert got.tolist() == [5, 70, 299, 0] == x.argmax(dim=-1).tolist()


def test_argmax_nan_and_infinities_as_torch() -> None:
    x = torch.randn(6, 200)
    x[0, 150] = float("nan")  # a NaN beats every number (torch: the first NaN)
    x[0, 10] = float("inf")
    x[1, [30, 190]] = float("nan")
    x[2] = float("-inf")  # a row of -inf alone: index 0
    x[3, :] = float("-inf")
    x[3, 77] = -1e30
    x[4, 120] = float("inf")
    x[4, 180] = float("inf")
    x[5, 0] = float("nan")
    x[5, 199] = float("nan")
    want = x.argmax(dim=-1)
    assert want.tolist()[:4] == [150, 30, 0, 77]  # what torch does, which the kernel must repeat
    assert torch.equal(argmax_triton(x, chunk=32), want)


def test_argmax_strided_rows_and_no_rows() -> None:
    big = torch.randn(5, 700)
    x = big[:, :600]  # a row stride wider than the row
    assert torch.equal(argmax_triton(x, chunk=128), x.argmax(dim=-1))
    assert argmax_triton(torch.empty(0, 10)).shape == (0,)


def test_argmax_refuses_what_it_cannot_do_and_copies_what_it_must() -> None:
    t = torch.randn(10, 4).t()  # a last dim that is not contiguous: copied, same answer
    assert torch.equal(argmax_triton(t, chunk=16), t.argmax(dim=-1))
    with pytest.raises(ValueError, match=r"\[R, V\]"):
        argmax_triton(torch.randn(3))
    with pytest.raises(ValueError, match="floating point"):
        argmax_triton(torch.ones(2, 5, dtype=torch.int64))
    with pytest.raises(ValueError, match="power of two"):
        argmax_triton(torch.randn(2, 5), chunk=100)


def test_the_sampler_picks_the_same_tokens_through_the_kernel() -> None:
    """Greedy rows and sampled rows (argmax of p / E) alike: the kernel is torch's argmax."""
    from workers.engine.sampler import Sampler, SamplingBatch

    logits = torch.randn(4, 3000)
    logits[1, [10, 2000]] = 9.0  # a tie on a greedy row
    greedy = SamplingBatch(all_greedy=True, temperature=None, greedy_mask=None, top_k=None, top_p=None,
                           generators=[None] * 4)
    mixed = SamplingBatch(all_greedy=False, temperature=torch.tensor([1.0, 1.0, 0.7, 1.3]),
                          greedy_mask=torch.tensor([True, True, False, False]), top_k=None, top_p=None,
                          generators=[None] * 4)
    for batch in (greedy, mixed):
        want = Sampler(torch.device("cpu"), seed=3)(logits, batch)
        got = Sampler(torch.device("cpu"), seed=3, argmax=lambda x: argmax_triton(x, chunk=256))(logits, batch)
        assert torch.equal(got, want)
    assert want[1] == 10
