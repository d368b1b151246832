"""The GEMV's variants (and the row argmax) compile for sm90 (Hopper) on this GPU-less machine: Triton's front end,
its sm90 passes and ptxas run without a device and catch what the interpreter lets through (a
loop-carried value changing shape cost a device run once); the programmatic dependent launch
reaches the PTX. In a subprocess: this folder's tests run Triton in interpreter mode."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = r'''
import json, sys
import triton, triton.language as tl, triton.language.extra.cuda
from triton.backends.compiler import GPUTarget
from kernels import fp8_gemv
jitted = fp8_gemv._fp8_gemv_kernel.jitted()
SIG = {"x_ptr": "*bf16", "res_ptr": "*bf16", "nw_ptr": "*bf16", "res_out_ptr": "*bf16", "b_ptr": "*fp8e4nv",
       "b_scale_ptr": "*fp32", "bias_ptr": "*bf16", "c_ptr": "*bf16", "part_ptr": "*fp32", "ss_ptr": "*fp32",
       "count_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_x": "i32", "stride_r": "i32",
       "stride_bn": "i32", "stride_c": "i32", "eps": "fp32"}
out = []
for prologue, residual, split, acc_2d, row, defer, pdl in json.loads(sys.argv[1]):
    consts = {"PROLOGUE": prologue, "HAS_RESIDUAL": residual, "HAS_BIAS": True, "BLOCK_N": 16, "BLOCK_K": 256,
              "SPLIT": split, "K_SPLIT": 2048, "ROW": row, "ACC_2D": acc_2d, "RMS_DEFER": defer, "PDL": pdl}
    sig = {n: SIG[n] for n in jitted.arg_names if n in SIG} | dict.fromkeys(consts, "constexpr")
    src = triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                       options={"num_warps": 4, "num_stages": 3, "launch_pdl": pdl})
    ptx = c.asm["ptx"]
    out.append({"cubin": len(c.asm["cubin"]), "wait": "griddepcontrol.wait" in ptx,
                "launch": "griddepcontrol.launch_dependents" in ptx, "atom": "atom." in ptx})
from kernels import argmax
aj = argmax._argmax_kernel.jitted()
consts = {"CHUNK": 4096, "PARTS": 32, "BLOCK_P": 32}
sig = {"x_ptr": "*fp32", "part_v_ptr": "*fp32", "part_i_ptr": "*i32", "count_ptr": "*i32", "out_ptr": "*i64",
       "V": "i32", "stride_x": "i32"} | dict.fromkeys(consts, "constexpr")
c = triton.compile(triton.compiler.ASTSource(fn=aj, signature=sig, constexprs=consts), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "num_stages": 3})
out.append({"cubin": len(c.asm["cubin"]), "atom": "atom." in c.asm["ptx"]})
print(json.dumps(out))
'''

CASES = [  # (prologue, residual, split, acc_2d, row, rms_defer, pdl)
    (1, True, 2, True, 4096, False, False), (1, True, 1, False, 0, False, True), (1, True, 2, True, 0, True, True),
    (2, False, 4, False, 0, False, True), (0, False, 2, True, 0, False, False),
]


def test_fp8_gemv_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, json.dumps(CASES)], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(got) == len(CASES) + 1
    assert got[-1]["cubin"] > 0 and got[-1]["atom"]  # kernels/argmax.py's kernel, its ticket
    for case, g in zip(CASES, got):
        split, pdl = case[2], case[6]
        assert g["cubin"] > 0, case
        assert g["wait"] == pdl and g["launch"] == pdl, (case, g)
        assert g["atom"] == (split > 1), (case, g)  # the split parts' arrival counter
