"""The GEMV's variants compile for sm90 (Hopper) on this GPU-less machine: Triton's front end,
its sm90 passes and ptxas run without a device and catch what the interpreter lets through (a
loop-carried value changing shape cost a device run once). In a subprocess: this folder's tests run Triton in interpreter mode.

One subprocess compiles every kernel of the module (the `compiled` fixture): starting Python and
importing torch, Triton and the kernels took ~2.3 s of each test's ~2.7 s when each test had its
own (a warm Triton cache). Each kernel's part runs on its own there (an exception in one part is
that part's result, reported by its test), and each test asserts on its own part."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

# Each part is a function of its cases returning what its test checks; PARTS runs the parts named in
# sys.argv[1] ({part: cases}) and prints {part: {"out": ...} or {"error": traceback}} as the last line.
SCRIPT = r'''
import json, sys, traceback
import triton
from triton.backends.compiler import GPUTarget


def gemv(cases):
    from kernels import fp8_gemv
    jitted = fp8_gemv._fp8_gemv_kernel.jitted()
    SIG = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "res_out_ptr": "*bf16", "b_ptr": "*fp8e4nv",
           "b_scale_ptr": "*fp32", "bias_ptr": "*bf16", "c_ptr": "*bf16", "part_ptr": "*fp32",
           "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_x": "i32", "stride_r": "i32",
           "stride_bn": "i32", "stride_c": "i32", "eps": "fp32"}
    out = []
    for prologue, residual, split, row in cases:
        consts = {"PROLOGUE": prologue, "HAS_RESIDUAL": residual, "HAS_BIAS": True, "BLOCK_N": 16, "BLOCK_K": 256,
                  "SPLIT": split, "K_SPLIT": 2048, "ROW": row}
        sig = {n: SIG[n] for n in jitted.arg_names if n in SIG} | dict.fromkeys(consts, "constexpr")
        src = triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts)
        c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 4, "num_stages": 3})
        ptx = c.asm["ptx"]
        out.append({"cubin": len(c.asm["cubin"]), "atom": "atom." in ptx})
    return out


def small_m(cases):
    from kernels import fp8_gemm
    jitted = fp8_gemm._fp8_gemm_rowwise_small_m_kernel.jitted()
    SIG = {"a_ptr": "*fp8e4nv", "a_scale_ptr": "*fp32", "b_ptr": "*fp8e4nv", "b_scale_ptr": "*fp32",
           "bias_ptr": "*bf16", "c_ptr": "*bf16", "part_ptr": "*fp32", "count_ptr": "*i32"}
    out = []
    for split, bias in cases:
        consts = {"HAS_BIAS": bias, "BLOCK_M": 128, "BLOCK_N": 64, "BLOCK_K": 128, "SPLIT": split, "K_SPLIT": 3584}
        sig = {n: SIG.get(n, "i32") for n in jitted.arg_names if n not in consts} | dict.fromkeys(consts, "constexpr")
        c = triton.compile(triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 3})
        ptx = c.asm["ptx"]
        out.append({"cubin": len(c.asm["cubin"]), "atom": "atom." in ptx, "wgmma": "wgmma" in ptx})
    return out


def decode(cases):
    from kernels import argmax, decode_attention
    jitted = decode_attention._decode_partial_kernel.jitted()
    PTRS = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "bt_ptr": "*i32",
            "seq_lens_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16",
            "kn_ptr": "*bf16", "vn_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64",
            "qk_scale": "fp32"}
    # what the launcher's specialisation tells Triton of these (16-divisible pointers and strides): it lets the
    # cache tiles load as 16-byte runs, as on the device
    DIV16 = {"q_ptr", "k_cache_ptr", "v_cache_ptr", "m_ptr", "l_ptr", "acc_ptr", "out_ptr", "kn_ptr", "vn_ptr",
             "cs_ptr", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "num_q_heads", "stride_qb", "stride_qh",
             "stride_cb", "stride_cs", "stride_ch", "stride_vcb", "stride_vch"}
    out = []
    for rope, split, window, maxnreg, v_t, *more in cases:
        bs, prefetch = more if more else (16, False)
        consts = {"GROUP": 4, "G_PACK": 4, "HEAD_CHUNKS": 1, "BLOCK_H": 16, "BLOCK_N": 64, "HEAD_DIM": 128,
                  "BLOCK_D": 128, "BLOCK_SIZE": bs, "SPLIT": split, "HAS_WINDOW": window, "PRECISION": None,
                  "DOT_FP32": False, "WIDEN_F16": True, "PREFETCH": prefetch, "ROPE": rope,
                  "V_T": v_t, "V_MAX": 448.0}
        sig = {n: PTRS.get(n, "i32") for n in jitted.arg_names if n not in consts} | dict.fromkeys(consts, "constexpr")
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jitted.arg_names) if n in DIV16}
        c = triton.compile(triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32),
                           options={"num_warps": 2, "num_stages": 3, **({"maxnreg": maxnreg} if maxnreg else {})})
        ptx = c.asm["ptx"]
        out.append({"cubin": len(c.asm["cubin"]), "mma": "mma" in ptx,
                    "maxnreg": f".maxnreg {maxnreg}" in ptx if maxnreg else None,
                    "byte_lds": ptx.count("ld.shared.b8") + ptx.count("ld.shared.u8")})
    for k, cst in ((argmax._chunk_argmax_kernel, {"CHUNK_": 2048}), (argmax._rows_argmax_kernel, {"BLOCK_C": 64})):
        j = k.jitted()
        types = {"x_ptr": "*fp32", "val_ptr": "*fp32", "idx_ptr": "*i32", "nan_ptr": "*i32", "out_ptr": "*i64"}
        sig = {n: types.get(n, "i32") for n in j.arg_names if n not in cst} | dict.fromkeys(cst, "constexpr")
        c = triton.compile(triton.compiler.ASTSource(fn=j, signature=sig, constexprs=cst),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
        out.append({"cubin": len(c.asm["cubin"]), "mma": False})
    return out


def prefill(cases):
    import re

    from kernels import prefill_attention
    jitted = prefill_attention._paged_attention_kernel.jitted()
    PTRS = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "out_ptr": "*bf16",
            "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "bt_ptr": "*i32", "qsl_ptr": "*i32",
            "seq_lens_ptr": "*i32", "qk_scale": "fp32"}
    # what the launcher does not specialise as 16-divisible (its lazy_jit arguments, and the float)
    NOT_DIV16 = {"window", "num_m_tiles", "num_splits", "num_seqs", "stride_bt", "bt_ptr", "qsl_ptr", "seq_lens_ptr",
                 "qk_scale"}
    out = []
    for widen, bm, bn, warps, stages, compact, *more in cases:
        v_t, bs, prefetch = more if more else (False, 16, False)
        consts = {"GROUP": 4, "G_PACK": 4, "HEAD_CHUNKS": 1, "BLOCK_Q": bm // 4, "BLOCK_M": bm, "BLOCK_N": bn,
                  "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": bs, "HAS_WINDOW": False, "SPLIT": True,
                  "PRECISION": None, "DOT_FP32": False, "WIDEN_F16": widen != "q", "QK_FP8": widen == "k8",
                  "V_T": v_t, "COMPACT": compact, "BLOCK_B": prefill_attention.COMPACT_MAX_SEQS + 1,
                  "PREFETCH": prefetch}
        sig = {n: PTRS.get(n, "i32") for n in jitted.arg_names if n not in consts} | dict.fromkeys(consts, "constexpr")
        # the cases with a layout given also get the launcher's divisibility hints (the loads it compiles then)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jitted.arg_names)
                 if more and n not in consts and n not in NOT_DIV16}
        c = triton.compile(triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        ptx = c.asm["ptx"]
        # the K and V tiles' shared buffers (local_alloc of memdesc<depth x rows x cols x f8>)
        depth = re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+xf8E4M3FN", c.asm["ttgir"])
        out.append({"cubin": len(c.asm["cubin"]), "wgmma": "wgmma" in ptx,
                    "e4m3_pairs": ptx.count("cvt.rn.f16x2.e4m3x2"), "f16_to_bf16": ptx.count("cvt.bf16.f16"),
                    "wgmma_e4m3": ptx.count("e4m3.e4m3"), "q_to_e4m3": ptx.count("cvt.rn.satfinite.e4m3x2.f32"),
                    "kv_buffers": sorted({int(x) for x in depth})})
    return out


def cast(cases):
    from kernels import fp8_quant
    jitted = fp8_quant._cast_e4m3_kernel.jitted()
    sig = {"x_ptr": "*bf16", "y_ptr": "*fp8e4nv", "scale_ptr": "*fp32", "T": "i32", "stride_x": "i32", "C": "i32",
           "V_COL": "i32"}
    consts = {"FP8_MAX_": 448.0, "MARGIN": 1.125, "HW_CAST": True, "BLOCK_R": 16, "BLOCK_C": 512}
    sig = {n: sig[n] for n in jitted.arg_names if n in sig} | dict.fromkeys(consts, "constexpr")
    c = triton.compile(triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts),
                       target=GPUTarget("cuda", 90, 32), options={"num_warps": 8, "num_stages": 1})
    ptx = c.asm["ptx"]
    return {"atom_min": "atom.global.gpu.acq_rel.min" in ptx,  # (a float min: int atomics by sign)
            "nan_clamp": "max.NaN." in ptx and "min.NaN." in ptx, "e4m3": "e4m3x2" in ptx}


def tma(cases):
    from kernels import fp8_gemm
    jitted = fp8_gemm._fp8_gemm_rowwise_tma_kernel.jitted()
    out = []
    for bm, bn, bk, warps, stages, split in cases:
        consts = {"HAS_BIAS": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT": split, "K_SPLIT": 2048}
        types = {"a_desc": f"tensordesc<fp8e4nv[{bm}, {bk}]>", "b_desc": f"tensordesc<fp8e4nv[{bn}, {bk}]>",
                 "a_scale_ptr": "*fp32", "b_scale_ptr": "*fp32", "bias_ptr": "*bf16", "c_ptr": "*bf16",
                 "part_ptr": "*fp32", "count_ptr": "*i32"}
        sig = {n: types.get(n, "i32") for n in jitted.arg_names if n not in consts} | dict.fromkeys(consts, "constexpr")
        c = triton.compile(triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
        ptx = c.asm["ptx"]
        out.append({"tma": ptx.count("cp.async.bulk.tensor"), "wgmma_e4m3": ptx.count("e4m3.e4m3"),
                    "ld_global_b": ptx.count("ld.global.b8") + ptx.count("ld.global.v4.b32"),
                    "atom": "atom." in ptx})
    return out


def rope_tiles(cases):
    import re

    from kernels import rope_cache
    PTRS = {"q_ptr": "*bf16", "k_ptr": "*bf16", "v_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32",
            "kc_ptr": "*fp8e4nv", "vc_ptr": "*fp8e4nv", "slot_ptr": "*i64", "y_ptr": "*fp8e4nv", "scale_ptr": "*fp32"}
    out = []
    for cast_, v_t, per_token in cases:
        consts = {"HQ": 32, "HK": 8, "HALF": 64, "BLOCK_HALF": 64, "BLOCK_SIZE": 64, "V_T": v_t, "V_MAX": 448.0,
                  "TOK": 32, "QG": 4, "WRITE_QK": False, "FP8_MAX_": 448.0, "MARGIN": 1.125, "HW_CAST": True}
        jitted = rope_cache._rope_cache_tiles_kernel.jitted()  # (it always casts)
        if per_token:  # rope_and_cache's kernel, one program a token: rope_and_cache, or with the cast (tile 0)
            jitted = rope_cache._rope_and_cache_kernel.jitted()
            consts = {k: v for k, v in consts.items() if k not in ("TOK", "QG")} | {"BLOCK_HQ": 32, "BLOCK_HK": 8,
                                                                                   "WRITE_QK": not cast_, "CAST": cast_}
        sig = {n: PTRS.get(n, "i32") for n in jitted.arg_names if n not in consts} | dict.fromkeys(consts, "constexpr")
        # the launcher's specialisation: 16-divisible pointers and strides (T is not specialised)
        attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jitted.arg_names) if n not in consts and n != "T"}
        c = triton.compile(triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts, attrs=attrs),
                           target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "num_stages": 1})
        ir, ptx = c.asm["ttgir"], c.asm["ptx"]
        layouts = dict(re.findall(r"^(#blocked\d*) = #ttg.blocked<(.*)>", ir, re.M))
        # each [D/2, TOK] e4m3 store's layout: V's stores into a keys-inner cache (and its cast rows)
        v_stores = [layouts[m] for m in re.findall(r"tt.store .*: tensor<64x32x!tt.ptr<f8E4M3FN>, (#blocked\d*)>", ir)]
        out.append({"cubin": len(c.asm["cubin"]), "v_stores": v_stores, "atom_min": "atom.global.gpu.acq_rel.min" in ptx,
                    "nan_clamp": "max.NaN." in ptx and "min.NaN." in ptx})
    return out


PARTS = {"gemv": gemv, "small_m": small_m, "decode": decode, "prefill": prefill, "cast": cast, "tma": tma,
         "rope_tiles": rope_tiles}
results = {}
for name, cases in json.loads(sys.argv[1]).items():
    try:
        results[name] = {"out": PARTS[name](cases)}
    except Exception:
        results[name] = {"error": traceback.format_exc()[-3000:]}
print(json.dumps(results))
'''

GEMV_CASES = [  # (prologue, residual, split, row: the RMSNorm row at once, or 0 in a loop)
    (1, True, 2, 4096), (1, True, 1, 0), (1, False, 1, 4096), (2, False, 4, 0), (0, False, 2, 0), (0, False, 1, 0),
]
SMALL_M_CASES = [(1, False), (4, True)]  # (split, bias)
DECODE_CASES = [  # (rope, split, window, maxnreg, v_t[, block size, prefetch]: 16, False unless given)
    (True, True, False, 0, False), (True, False, True, 0, False), (False, True, False, 0, False),
    (False, False, False, 128, False), (True, False, False, 0, True), (True, True, True, 0, True),
    (False, False, False, 0, True),
    # blocks of 64 tokens (one block a key tile: bench/gpu_run.sh blocks), with the block ids a tile ahead
    (False, False, False, 0, False, 64, True), (False, False, False, 0, True, 64, True),
]
PREFILL_CASES = [  # (widen, block_m, block_n, warps, stages, compact[, V keys inner, block size, prefetch])
    ("q", 64, 64, 4, 2, False), ("fp16", 64, 64, 4, 2, False), ("q", 128, 128, 8, 3, False),
    ("fp16", 128, 128, 8, 3, False), ("k8", 64, 64, 4, 2, False), ("k8", 128, 128, 8, 3, False),
    ("fp16", 64, 64, 4, 2, True), ("fp16", 128, 128, 8, 3, True),
    # 2048 cached + 128's launch in the engine's layout (blocks of 64, V keys inner), at 3 stages without and
    # with the block ids a tile ahead
    ("fp16", 64, 64, 4, 3, True, True, 64, False), ("fp16", 64, 64, 4, 3, True, True, 64, True),
]

ROPE_TILES_CASES = [(True, True, False), (True, False, False),  # (cast, V keys inner, rope_and_cache's per-token
                    (True, True, True), (False, True, True)]  # kernel)


def tma_builtin() -> set:
    """fp8_gemm's built-in TMA tiles for qkv, o and down at 128 and 256 rows."""
    from kernels.fp8_gemm import tma_default

    return {t for n, k in ((6144, 4096), (4096, 4096), (4096, 14336)) for t in tma_default(n, k) or () if t}


def tma_cases() -> list:  # (block_m, block_n, block_k, warps, stages, split)
    return [(128, 64, 128, 4, 4, 1), (128, 32, 128, 4, 6, 2), (128, 128, 128, 8, 4, 1), *sorted(tma_builtin())]


@pytest.fixture(scope="module")
def compiled() -> dict:
    """Every part's cases, compiled for sm90 in one subprocess (Triton not in interpreter mode there)."""
    cases = {"gemv": GEMV_CASES, "small_m": SMALL_M_CASES, "decode": DECODE_CASES, "prefill": PREFILL_CASES,
             "cast": None, "rope_tiles": ROPE_TILES_CASES}
    with contextlib.suppress(Exception):  # else test_tma_gemm_compiles_for_sm90 raises it, the others run
        cases["tma"] = tma_cases()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    env.pop("TRITON_INTERPRET", None)
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(cases)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert set(got) == set(cases), sorted(got)
    return got


def part(compiled: dict, name: str):
    """One part's result; its traceback fails the test when it raised."""
    r = compiled[name]
    assert "error" not in r, r.get("error")
    return r["out"]


def test_fp8_gemv_compiles_for_sm90(compiled):
    got = part(compiled, "gemv")
    assert len(got) == len(GEMV_CASES)
    for case, g in zip(GEMV_CASES, got):
        split = case[2]
        assert g["cubin"] > 0, case
        assert g["atom"] == (split > 1), (case, g)  # the split parts' arrival counter


def test_small_m_gemm_split_k_compiles_for_sm90(compiled):
    """The few-row FP8 GEMM at 128 rows, whole K and in 4 parts: Hopper's FP8 MMA (wgmma), and the
    parts' arrival counter only where K is split."""
    got = part(compiled, "small_m")
    assert [(g["cubin"] > 0, g["wgmma"], g["atom"]) for g in got] == [(True, True, s > 1) for s, _ in SMALL_M_CASES]


def test_decode_attention_and_argmax_compile_for_sm90(compiled):
    """Decode attention over an fp8 cache with rope_and_cache fused in (or not), split or not, with a
    window or not, one under a register cap (the launcher's maxnreg, which must reach ptxas), and
    the two argmax kernels: Triton's sm90 passes and ptxas, no device. The V cache in rows (as K) has
    the fp8 V tile read from shared memory a byte at a time (each tensor-core operand register holds
    two consecutive keys, Hk x D bytes apart there): 128 byte loads a thread a tile (Triton 3.6 and
    3.9: 1350 and 1017 instructions a tile in all); with its keys innermost (kernels/kv_layout.py),
    none in the loop (791 and 706). On an H100 that was not faster (bench/results/2026-12-06-v-layout-h100.md)."""
    cases = DECODE_CASES
    got = part(compiled, "decode")
    assert [g["cubin"] > 0 for g in got] == [True] * (len(cases) + 2)
    assert all(g["mma"] for g in got[: len(cases)])  # the score and value products on the tensor cores
    assert got[3]["maxnreg"] is True, "the register cap did not reach the PTX"
    rows = [g["byte_lds"] for c, g in zip(cases, got) if not c[4]]
    inner = [g["byte_lds"] for c, g in zip(cases, got) if c[4]]
    assert min(rows) >= 128 and max(inner) <= 8, (rows, inner)  # (8 elsewhere in the split + rope variant)


def test_prefill_attention_fp8_cache_compiles_for_sm90(compiled):
    """The prefill attention over an fp8 cache, tiles widened to bf16 (q's dtype) or to fp16, at the
    engine's two tile shapes: both on Hopper's MMA (wgmma); e4m3 widens in pairs to fp16 either way,
    and the fp16 path drops the per-value fp16 -> bf16 conversion that the bf16 path adds to each
    loaded K and V tile (what made an fp8 cache slower than a bf16 one on the H200). widen="k8":
    QK^T on the e4m3 wgmma (q cast to e4m3 by the hardware's cvt), only V widened. The compact grid (each
    program's tile found by a cumsum over the batch's tile counts) at both tile shapes."""
    got = part(compiled, "prefill")
    for case, g in zip(PREFILL_CASES, got, strict=True):
        widen = case[0]
        assert g["cubin"] > 0 and g["wgmma"] and g["e4m3_pairs"] > 0, (case, g)
        assert (g["f16_to_bf16"] == 0) == (widen != "q"), (case, g)
        assert (g["wgmma_e4m3"] > 0) == (widen == "k8") and (g["q_to_e4m3"] > 0) == (widen == "k8"), (case, g)
    # k8 widens V alone: half the e4m3 pairs of fp16's K and V (same tiles)
    assert got[4]["e4m3_pairs"] < got[1]["e4m3_pairs"] and got[5]["e4m3_pairs"] < got[3]["e4m3_pairs"], got


def test_prefill_prefetch_gives_the_tiles_a_second_buffer_for_sm90(compiled):
    """The cached-prefix launch in the engine's layout (blocks of 64, V keys inner) at 3 stages: with each tile's
    block ids loaded in the iteration before (prefetch), the K and V tiles get two shared buffers, so the next
    tile's copy can run under this tile's math; without, one (the copy waits for this tile to be read). Triton
    3.6 and 3.9 alike (bench/probe_attention_sm90.py)."""
    got = part(compiled, "prefill")
    without, with_prefetch = got[-2:]
    assert without["kv_buffers"] == [1] and with_prefetch["kv_buffers"] == [2], (without, with_prefetch)


def test_fp8_attention_cast_compiles_for_sm90(compiled):
    """FP8 attention's q | k | v cast (kernels/fp8_quant.py): one atomic min for O's scale, the clamp
    keeping NaN (max.NaN / min.NaN: the interpreter cannot show it, its fp8 cast turns NaN into 384), the
    hardware's e4m3 conversion."""
    got = part(compiled, "cast")
    assert got == {"atom_min": True, "nan_clamp": True, "e4m3": True}, got


def test_tma_gemm_compiles_for_sm90(compiled):
    """The few-row FP8 GEMM with TMA loads (kernels/fp8_gemm.py's candidate for 65-256 rows): A and B come
    by bulk tensor copies (cp.async.bulk.tensor), not per-thread loads, into the e4m3 wgmma; the split's
    arrival counter only when split."""
    assert len(tma_builtin()) == 3  # qkv, o and down's tiles at 128 and 256 rows (some shared)
    cases = tma_cases()
    got = part(compiled, "tma")
    for case, g in zip(cases, got, strict=True):
        assert g["tma"] > 0 and g["wgmma_e4m3"] > 0, (case, g)
        assert g["atom"] == (case[5] > 1), (case, g)


def test_rope_tiles_compile_for_sm90(compiled):
    """rope_cache_cast's kernels: tiles of tokens, V keys inner or in rows; and rope_and_cache's per-token
    kernel with the cast (tile 0) and without (rope_and_cache itself). Tiles, V keys inner: V's
    stores into the cache run the warp's lanes along the tokens (threadsPerWarp [1, 32], order [1, 0] over
    [D/2, tokens]): a prompt's consecutive slots are one row's consecutive bytes, the store the per-token
    kernel makes byte by byte into 64-byte rows far apart. The cast: O's scale by a float atomic min, the
    clamp keeping NaN, as cast_e4m3's."""
    got = part(compiled, "rope_tiles")
    along_tokens = "threadsPerWarp = [1, 32], warpsPerCTA = [4, 1], order = [1, 0]"
    for (cast_, v_t, per_token), g in zip(ROPE_TILES_CASES, got, strict=True):
        assert g["cubin"] > 0, g
        if v_t and not per_token:
            cache_stores = g["v_stores"][:2]  # the cache's two halves come first; then the cast rows' (d inner)
            assert len(cache_stores) == 2 and all(along_tokens in lay for lay in cache_stores), g["v_stores"]
        assert g["atom_min"] == cast_ and g["nan_clamp"] == cast_, g
