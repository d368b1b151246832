"""Importing kernels/* never imports triton; the CPU tests really run Triton's interpreter."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
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


def test_get_ops_prefill_widen_switch(monkeypatch) -> None:
    """FIRSTTOKEN_PREFILL_WIDEN=q: the prefill attention and its warm-up widen an fp8 cache to q's
    dtype (the A/B of the fp16 default); unset, neither is bound to a choice."""
    monkeypatch.setenv("FIRSTTOKEN_PREFILL_WIDEN", "q")
    ops = get_ops("triton")
    assert ops.prefill_attention.__name__ == "paged_attention_triton"
    assert ops.prefill_attention.keywords == {"widen": "q"}
    assert ops.warm_up.keywords == {"widen": "q", "decode_tiles": {}}
    monkeypatch.delenv("FIRSTTOKEN_PREFILL_WIDEN")
    ops = get_ops("triton")
    assert not hasattr(ops.prefill_attention, "keywords") and ops.warm_up.keywords == {"decode_tiles": {}}
    # QK^T on FP8 tensor cores: bound into the warm-up too; a value it does not know fails, naming the variable
    monkeypatch.setenv("FIRSTTOKEN_PREFILL_WIDEN", "k8")
    ops = get_ops("triton")
    assert ops.prefill_attention.keywords == {"widen": "k8"}
    assert ops.warm_up.keywords == {"widen": "k8", "decode_tiles": {}}
    monkeypatch.setenv("FIRSTTOKEN_PREFILL_WIDEN", "bf8")
    with pytest.raises(ValueError, match="FIRSTTOKEN_PREFILL_WIDEN"):
        get_ops("triton")
    # the grid (compact by default, per sequence with 0) and the block ids a tile ahead (off by default): nothing
    # bound unless set, then bound into the launches and the warm-up alike; a value other than 0 or 1 fails
    monkeypatch.delenv("FIRSTTOKEN_PREFILL_WIDEN")
    assert not hasattr(get_ops("triton").prefill_attention, "keywords")
    for name, key in (("FIRSTTOKEN_PREFILL_COMPACT", "compact"), ("FIRSTTOKEN_PREFILL_PREFETCH", "prefetch")):
        for value, bound in (("0", False), ("1", True)):
            monkeypatch.setenv(name, value)
            ops = get_ops("triton")
            assert ops.prefill_attention.keywords == {key: bound}
            assert ops.warm_up.keywords == {key: bound, "decode_tiles": {}}
        monkeypatch.setenv(name, "yes")
        with pytest.raises(ValueError, match=name):
            get_ops("triton")
        monkeypatch.delenv(name)


def test_get_ops_decode_tiles_switch(monkeypatch) -> None:
    """FIRSTTOKEN_DECODE_TILES: decode attention's tile keywords, bound into both decode ops and the
    warm-up (which compiles what serving launches); the fused op runs with them as the reference does;
    a malformed value fails when the ops are bound, naming the variable."""
    from kernels.decode_attention import TILES_ENV, decode_rope_attention_ref

    monkeypatch.setenv(TILES_ENV, '{"prefetch": true, "num_stages": 4, "block_n": 16}')
    ops = get_ops("triton")
    want = {"prefetch": True, "num_stages": 4, "block_n": 16}
    assert ops.decode_attention.keywords == want and ops.decode_rope_attention.keywords == want
    assert ops.decode_attention.__name__ == "decode_attention_triton"
    assert ops.warm_up.keywords == {"decode_tiles": want}
    g = torch.Generator().manual_seed(3)
    b, hq, hk, d, bs, nblk = 3, 4, 2, 16, 4, 12
    kc = torch.randn(nblk, bs, hk, d, generator=g)
    vc = torch.randn(nblk, bs, hk, d, generator=g)
    tables = torch.arange(nblk, dtype=torch.int32).view(b, nblk // b)
    lens = torch.tensor([5, 16, 9], dtype=torch.int32)
    q, k, v = (torch.randn(b, h, d, generator=g) for h in (hq, hk, hk))
    pos = (lens - 1).long()
    half = torch.randn(32, d // 2, generator=g)
    cos_sin = torch.cat([half.cos(), half.sin()], dim=1)
    slots = tables.long().gather(1, (pos // bs).view(-1, 1)).view(-1) * bs + pos % bs
    kc2, vc2 = kc.clone(), vc.clone()
    got = ops.decode_rope_attention(q, k, v, pos, cos_sin, kc, vc, slots, tables, lens, d**-0.5)
    ref = decode_rope_attention_ref(q, k, v, pos, cos_sin, kc2, vc2, slots, tables, lens, d**-0.5)
    torch.testing.assert_close(got, ref, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(kc, kc2)
    for bad in ('{"prefetch": 1}', '{"block_m": 64}', "[64]", "fast"):
        monkeypatch.setenv(TILES_ENV, bad)
        with pytest.raises(ValueError, match=TILES_ENV):
            get_ops("triton")
    monkeypatch.delenv(TILES_ENV)
    ops = get_ops("triton")
    assert not hasattr(ops.decode_attention, "keywords") and not hasattr(ops.decode_rope_attention, "keywords")


def test_direct_launch_reuses_the_compiled_kernel(monkeypatch) -> None:
    """After the first launch of a specialisation, `launch` calls the compiled kernel with every
    argument in signature order and a three-axis grid (as Triton's own launcher does)."""
    import kernels._triton as kt

    calls = []

    class Compiled:  # Triton's CompiledKernel: kernel[grid](*all_args), grid read as grid[0..2]
        def __getitem__(self, grid):
            return lambda *a: calls.append(("direct", (grid[0], grid[1], grid[2]), a))

    class Jitted:
        arg_names = ("x_ptr", "n", "BLOCK")

        def __getitem__(self, grid):
            def run(*a, **kw):
                calls.append(("jit", grid, a, kw))
                return Compiled()

            return run

    def kernel(x_ptr, n, BLOCK):  # the signature the launch is checked against
        pass

    k = kt.LazyKernel(kernel)
    k._jitted = Jitted()
    x = torch.zeros(4)
    k.launch((3,), (x, 5), {"BLOCK": 64}, 4, 3, True)
    k.launch((7,), (x, 6), {"BLOCK": 64}, 4, 3, True)  # same specialisation (6 and 5: not 1, not %16)
    k.launch((7,), (x, 16), {"BLOCK": 64}, 4, 3, True)  # 16 is specialised on: Triton's path again
    assert [c[0] for c in calls] == ["jit", "direct", "jit"]
    assert calls[1][1] == (7, 1, 1) and calls[1][2] == (x, 6, 64)
    monkeypatch.setattr(kt, "FAST_LAUNCH", False)
    k.launch((7,), (x, 6), {"BLOCK": 64}, 4, 3, True)
    assert calls[-1][0] == "jit"


def test_constexprs_out_of_signature_order_are_refused() -> None:
    """The direct launch passes constexprs by position: given in another order than the signature's,
    Triton's slow dispatch served every call (decode's V_T / ROPE once, ~0.2 ms a launch), so the
    launch refuses them on every path, the interpreter's included."""
    import kernels._triton as kt

    def kernel(x_ptr, n, A, B):
        pass

    k = kt.LazyKernel(kernel)
    with pytest.raises(ValueError, match="signature"):
        k.launch((1,), (torch.zeros(1), 1), {"B": 1, "A": 2}, 4, 1, False)
    with pytest.raises(ValueError, match="signature"):
        k.launch((1,), (torch.zeros(1), 1), {"A": 2}, 4, 1, False)


def test_do_not_specialize_keys_ints_by_width_only() -> None:
    """A `do_not_specialize` int (a tile or split count) never makes a second specialisation:
    5, 16 and 1 all reuse the first compiled kernel (a compile stalls serving for ~1 s)."""
    import pytest

    import kernels._triton as kt

    calls = []

    class Compiled:
        def __getitem__(self, grid):
            return lambda *a: calls.append(("direct", a))

    class Jitted:
        arg_names = ("x_ptr", "n", "BLOCK")

        def __getitem__(self, grid):
            def run(*a, **kw):
                calls.append(("jit", a))
                return Compiled()

            return run

    def kernel(x_ptr, n, BLOCK):
        pass

    k = kt.LazyKernel(kernel, ("n",))
    k._jitted = Jitted()
    x = torch.zeros(4)
    for n in (5, 16, 1, 7):
        k.launch((1,), (x, n), {"BLOCK": 64}, 4, 3, True)
    assert [c[0] for c in calls] == ["jit", "direct", "direct", "direct"]
    assert k.num_compiles == 1
    k.launch((1,), (x, 1 << 40), {"BLOCK": 64}, 4, 3, True)  # a 64-bit value is another signature
    assert calls[-1][0] == "jit" and k.num_compiles == 2
    with pytest.raises(ValueError, match="no argument"):
        kt.LazyKernel(kernel, ("m",))

    # a pointer named in do_not_specialize_on_alignment: a slice at an odd offset reuses the kernel
    calls.clear()
    k = kt.LazyKernel(kernel, (), ("x_ptr",))
    k._jitted = Jitted()
    y = torch.zeros(8, dtype=torch.int32)
    k.launch((1,), (y, 3), {"BLOCK": 64}, 4, 3, True)
    k.launch((1,), (y[1:], 3), {"BLOCK": 64}, 4, 3, True)
    assert [c[0] for c in calls] == ["jit", "direct"]
    k2 = kt.LazyKernel(kernel)
    k2._jitted = Jitted()
    k2.launch((1,), (y, 3), {"BLOCK": 64}, 4, 3, True)
    k2.launch((1,), (y[1:], 3), {"BLOCK": 64}, 4, 3, True)  # specialised on alignment: Triton's path
    assert [c[0] for c in calls] == ["jit", "direct", "jit", "jit"]
