"""Hold some SMs of a GPU with spinning programs, so that the kernels timed meanwhile run on the rest:
an H100 with 92 of its 132 SMs has an H200's memory bandwidth per SM (3.35 against 4.8 TB/s over the
same SM count and clocks), which tells whether a memory-bound kernel is short of bytes in flight per SM
on the H200 when no H200 can be had (bench_decode_tiles.py --hog-sms).

Each spinning program takes every register of its SM (512 threads holding 112 live fp32 values each,
~128 registers a thread: 65536), so nothing else is placed there; it does arithmetic only (no memory
traffic) until the block's end sets its flag; the block starts once every one reports it runs.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kernels._triton import lazy_jit

tl: Any = None  # triton.language, bound at the first launch


@lazy_jit
def _spin_kernel(flag_ptr, out_ptr, max_rounds, A: tl.constexpr, B: tl.constexpr, C: tl.constexpr):
    # flag_ptr[0]: the release (set by the host's stream), flag_ptr[1]: programs running (each adds one)
    pid = tl.program_id(0)
    tl.atomic_add(flag_ptr + 1, 1, sem="relaxed")
    x = tl.arange(0, A).to(tl.float32) + pid
    y = tl.arange(0, B).to(tl.float32)
    z = tl.arange(0, C).to(tl.float32)
    stop = tl.load(flag_ptr, volatile=True)
    rounds = 0
    while (stop == 0) & (rounds < max_rounds):  # the bound: a lost release cannot hang the device
        for _ in tl.static_range(8):
            x = x * 0.9990234375 + 0.0009765625
            y = y * 0.9990234375 + 0.0009765625
            z = z * 0.9990234375 + 0.0009765625
        stop = tl.load(flag_ptr, volatile=True)
        rounds += 1
    tl.store(out_ptr + pid * A + tl.arange(0, A), x + tl.sum(y, 0) + tl.sum(z, 0))


class SmHog:
    """`with SmHog(n):` n SMs spin (on a stream of their own) until the block ends (at most max_rounds
    rounds of ~2 us). Inside the block nothing may synchronise the whole device (torch.cuda.synchronize,
    empty_cache, a cudaMalloc or cudaFree): it would wait for the spinners. Allocate and compile first;
    time with events and stream syncs."""

    def __init__(self, n: int, device: str = "cuda", max_rounds: int = 10_000_000) -> None:
        self.n = n
        self.max_rounds = max_rounds
        if n <= 0:  # holds nothing: a no-op block, on any machine
            return
        if not torch.cuda.is_available():
            raise RuntimeError("SmHog holds SMs of a CUDA device; none is available")
        self.flag = torch.zeros(2, dtype=torch.int32, device=device)  # release, programs running
        self.out = torch.empty((n, 32768), dtype=torch.float32, device=device)
        self.stream = torch.cuda.Stream(device=device)
        self.release_stream = torch.cuda.Stream(device=device)

    def __enter__(self) -> SmHog:
        if self.n > 0:
            self.flag.zero_()
            torch.cuda.synchronize()
            with torch.cuda.stream(self.stream):
                _spin_kernel[(self.n,)](self.flag, self.out, self.max_rounds, A=32768, B=16384, C=8192,
                                        num_warps=16)
            # what the timing needs: every spinner running before the first timed kernel is launched
            deadline = time.monotonic() + 10.0
            with torch.cuda.stream(self.release_stream):  # a stream sync of its own, not the device's
                while int(self.flag[1].item()) < self.n:
                    if time.monotonic() > deadline:
                        self.flag[:1].fill_(1)
                        raise RuntimeError(f"SmHog: {int(self.flag[1].item())} of {self.n} spinners running "
                                           "after 10 s (too many for the device, or its SMs are taken)")
                    time.sleep(0.001)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.n > 0:
            with torch.cuda.stream(self.release_stream):
                self.flag[:1].fill_(1)
            self.stream.synchronize()
