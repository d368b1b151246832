"""Pull a tensor's bytes into the GPU's L2 cache ahead of the kernel that reads them.

A decode step of a few sequences reads each layer's weights once, at the memory's rate, but its
attention (a few MB of KV) leaves the DRAM idle for several microseconds a layer. Launched on a
side branch beside the attention, `l2_prefetch` issues `prefetch.global.L2::evict_last` for every
128-byte line of the next projection's weight (o_proj's: 16 MB in FP8 on Llama-3.1-8B, a third of
the H100's / H200's 50 MB L2), so that projection reads L2 instead of DRAM. A hint: the results
never depend on it, only the time. A no-op off CUDA (the interpreter has no inline PTX).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from kernels._triton import cdiv, lazy_jit, num_sms

tl: Any = None  # triton.language, bound at the first launch by kernels._triton.lazy_jit

LINE = 128  # bytes a prefetch covers (an L2 line)


@lazy_jit(do_not_specialize=("base", "n_lines", "lines_per_prog"))
def _l2_prefetch_kernel(
    base,  # the first byte's address (int64; a multiple of the 128-byte line)
    n_lines,  # lines to prefetch
    lines_per_prog,  # lines per program (the last program's may run past n_lines: clamped)
    BLOCK: tl.constexpr,  # lines per loop iteration of a program (one per thread)
):
    start = tl.program_id(0).to(tl.int64) * lines_per_prog
    for i in range(0, lines_per_prog, BLOCK):
        line = tl.minimum(start + i + tl.arange(0, BLOCK), n_lines - 1)  # past the end: the last line again
        tl.inline_asm_elementwise("prefetch.global.L2::evict_last [$1];\n\tmov.u32 $0, 0;", "=r,l",
                                  [base + line * 128], dtype=tl.int32, is_pure=False, pack=1)


def l2_prefetch(t: torch.Tensor, programs: int | None = None, block: int = 128) -> None:
    """Ask the L2 to fetch t's bytes (a contiguous tensor on CUDA); returns at once on other devices."""
    if t.device.type != "cuda" or t.numel() == 0:
        return
    if not t.is_contiguous():
        raise ValueError("l2_prefetch: the tensor must be contiguous")
    base = t.data_ptr() // LINE * LINE
    n_lines = cdiv(t.data_ptr() + t.numel() * t.element_size() - base, LINE)
    progs = programs or num_sms(t.device)
    per = cdiv(cdiv(n_lines, progs), block) * block
    _l2_prefetch_kernel.launch((cdiv(n_lines, per),), (base, n_lines, per), {"BLOCK": block}, 4, 1, True)


_SIDE: dict = {}  # device -> the side stream prefetches run on


@contextmanager
def prefetch_beside(t: torch.Tensor | None) -> Iterator[None]:
    """The with-block runs on the current stream while a side stream asks the L2 for t's bytes (a
    fork and a join, which a CUDA graph captures as a parallel branch); the current stream waits for
    the side one at the exit, before whatever reads t. None, or a tensor off CUDA: just the block."""
    if t is None or t.device.type != "cuda":
        yield
        return
    cur = torch.cuda.current_stream(t.device)
    side = _SIDE.get(t.device)
    if side is None:
        side = _SIDE[t.device] = torch.cuda.Stream(t.device)
    side.wait_stream(cur)
    with torch.cuda.stream(side):
        l2_prefetch(t)
    try:
        yield
    finally:
        cur.wait_stream(side)
