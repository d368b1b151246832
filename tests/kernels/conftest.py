"""Kernel tests run the Triton kernels on CPU through Triton's interpreter.

TRITON_INTERPRET is read by `triton.jit`, which kernels/_triton.py applies lazily at a kernel's
first launch, so setting it here (when pytest collects this folder, before any test runs) is
enough even when another test file imported torch or triton first. test_kernel_lazy.py checks it.
"""

from __future__ import annotations

import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch


@pytest.fixture
def poison_empty(monkeypatch: pytest.MonkeyPatch) -> None:
    """Make every `torch.empty` (the launchers' outputs and intermediates) start as NaN / -1."""
    real_empty = torch.empty

    def empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        elif t.dtype != torch.bool:
            t.fill_(-1)
        return t

    monkeypatch.setattr(torch, "empty", empty)


@pytest.fixture(autouse=True)
def _seed() -> None:
    torch.manual_seed(1234)
