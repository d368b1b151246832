"""bench/sm_hog.py, the H100 standing in for an H200: its spinning program must own a whole SM (its
register file full, so nothing else is placed there) and move no memory; holding no SM is a no-op."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

SCRIPT = r'''
import json, subprocess, sys, tempfile
from pathlib import Path
import triton
from triton.backends.compiler import GPUTarget
from bench import sm_hog
j = sm_hog._spin_kernel.jitted()
consts = {"A": 32768, "B": 16384, "C": 8192}
sig = {"flag_ptr": "*i32", "out_ptr": "*fp32", "max_rounds": "i32"} | dict.fromkeys(consts, "constexpr")
c = triton.compile(triton.compiler.ASTSource(fn=j, signature=sig, constexprs=consts),
                   target=GPUTarget("cuda", 90, 32), options={"num_warps": 16})
with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
    f.write(c.asm["cubin"])
    f.flush()
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    usage = subprocess.run([str(tool), "-res-usage", f.name], capture_output=True, text=True).stdout
ptx = c.asm["ptx"]
print(json.dumps({"usage": usage, "volatile": "ld.volatile" in ptx,
                  "global": [next(w for w in l.split() if not w.startswith("@")) for l in ptx.splitlines()
                             if ".global" in l and any(op in l for op in ("ld.", "st.", "atom.", "red."))]}))
'''


def test_holding_no_sm_is_a_no_op_on_any_machine():
    from bench.sm_hog import SmHog

    with SmHog(0) as hog:
        assert hog.n == 0


def test_the_spinner_fills_its_sm_and_touches_no_memory():
    """Compiled for sm90 here (no device): 512 threads x 128 registers = the SM's 65536, no local memory
    (no spills, which would be memory traffic), one atomic add (it reports that it runs, once), one volatile
    load (the release flag, each round) and one store (its result, once at the end) as its only global
    accesses."""
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    regs = int(re.search(r"REG:(\d+)", got["usage"]).group(1))
    local = int(re.search(r"LOCAL:(\d+)", got["usage"]).group(1))
    assert regs * 512 >= 65536, got["usage"]  # the register file full: no other program fits beside it
    assert local == 0, got["usage"]
    assert got["volatile"]
    loads = {g for g in got["global"] if g.startswith("ld.")}
    stores = [g for g in got["global"] if g.startswith("st.")]
    atomics = [g for g in got["global"] if g.startswith(("atom.", "red."))]  # red: its result unused
    assert loads == {"ld.volatile.global.b32"} and stores and all(g.startswith("st.global") for g in stores), got
    assert len(atomics) == 1 and ".add." in atomics[0], got  # each program reports it runs, once
