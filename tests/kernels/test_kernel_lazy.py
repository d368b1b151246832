"""Importing kernels/* never imports triton; the CPU tests really run Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import torch

from kernels.ops import get_ops
from kernels.silu_mul import _silu_and_mul_kernel, silu_and_mul_triton


def test_import_does_not_import_triton() -> None:
    code = (
        "import sys\n"
        "import kernels, kernels.ops, kernels.rmsnorm, kernels.silu_mul, kernels.rope_cache\n"
        "import kernels.prefill_attention, kernels.decode_attention\n"
        "kernels.ops.get_ops('triton')\n"
        "assert 'triton' not in sys.modules, 'triton imported at import time'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_interpreter_is_on() -> None:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    silu_and_mul_triton(torch.randn(3, 8))
    assert type(_silu_and_mul_kernel.jitted()).__name__ == "InterpretedFunction"


def test_get_ops_triton() -> None:
    ops = get_ops("triton")
    assert ops.name == "triton"
    assert ops.rms_norm.__name__ == "rms_norm_triton"
    assert ops.decode_attention.__name__ == "decode_attention_triton"
    assert ops.prefill_attention.__name__ == "paged_attention_triton"
