"""Lazy Triton binding for the kernel files: importing `kernels.*` never imports triton.

A kernel is written at module level as a plain function whose body uses the module-global
name `tl`; `lazy_jit` wraps it, and on the first launch imports triton, binds `tl` in the
kernel's module and applies `triton.jit`. Because `triton.jit` runs at that moment,
`TRITON_INTERPRET=1` set any time before the first launch selects the interpreter.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


class LazyKernel:
    """A Triton kernel jitted at its first launch; `kernel[grid](...)` as with `triton.jit`."""

    def __init__(self, fn: Callable) -> None:
        self.fn = fn
        self._jitted: Any = None

    def jitted(self) -> Any:
        """Return the `triton.jit` function (jitting it on first use)."""
        if self._jitted is None:
            import triton
            import triton.language as tl

            self.fn.__globals__["tl"] = tl
            self._jitted = triton.jit(self.fn)
        return self._jitted

    def __getitem__(self, grid: Any) -> Any:
        return self.jitted()[grid]


def lazy_jit(fn: Callable) -> LazyKernel:
    """Decorator: `triton.jit` deferred to the first launch (see the module docstring)."""
    return LazyKernel(fn)


def cdiv(a: int, b: int) -> int:
    """Ceiling division of two non-negative ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (1 for n <= 1)."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def num_sms(device: Any) -> int:
    """Multiprocessor count of a CUDA device; a small stand-in (8) for the CPU interpreter."""
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 8


def check(cond: bool, msg: str) -> None:
    """Raise ValueError(msg) unless cond (launcher argument checks)."""
    if not cond:
        raise ValueError(msg)
