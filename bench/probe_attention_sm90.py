"""How Triton schedules the attention loops for Hopper, compiled on a machine with no GPU: shared buffers,
registers and programs an SM, from the TTGIR and Triton's bundled ptxas.

    python3 bench/probe_attention_sm90.py
    PYTHONPATH=/path/to/triton-3.6 python3 bench/probe_attention_sm90.py   # the device image's Triton

Cached prefix (TTFT 2048 cached + 128). The loop spends ~25 us a layer in
`kernels.prefill_attention._paged_attention_kernel`, bound by the latency of its serial chain (load, QK^T,
softmax, PV) with two programs an SM (session 19's ncu).
- The engine's form of that launch is compiled at 2, 3 and 4 pipeline stages: fp8 cache, blocks of 64, V keys
  inner, K/V widened to fp16, splits, the compact grid, 64 x 64 tiles, 4 warps.
- The K and V tiles' buffer count is reported. With 1, the next tile's copy starts only after this tile is read,
  so no load overlaps the tile's math. The same launch with each tile's block ids loaded a tile ahead
  (`paged_attention_triton(prefetch=True)`, as decode's prefetch) is compiled at 3 and 4 stages.
- Then a minimal loop of the same math, with K and V^T by TMA (one cache block a tile), asks for Triton's
  automatic warp specialization (`tl.range(..., warp_specialize=True)`: the producer/consumer split
  FlashAttention-3 builds by hand) at 4 and at 8 warps.

Decode (the throughput shape's ~27 of ~43 ms a step on the H200). `_decode_partial_kernel` is compiled in the
engine's form (fp8 cache, blocks of 64, V keys inner, block ids a tile ahead, 64-key tiles, 2 warps, 3 stages)
and in the variants `gpu_run.sh dec_rate` times. For each, the programs an SM that registers and shared memory
allow, which bounds the bytes a multiprocessor keeps in flight.

Prints one JSON line a case.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

TARGET = GPUTarget("cuda", 90, 32)
PTRS = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "out_ptr": "*bf16",
        "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "bt_ptr": "*i32", "qsl_ptr": "*i32",
        "seq_lens_ptr": "*i32", "qk_scale": "fp32"}
# what the launcher does not specialise (kernels/prefill_attention.py's lazy_jit arguments, and the float)
NOT_DIV16 = {"window", "num_m_tiles", "num_splits", "num_seqs", "stride_bt", "bt_ptr", "qsl_ptr", "seq_lens_ptr",
             "qk_scale"}


def registers(ptx: str) -> int | None:
    """Registers a thread, from the ptxas Triton ships (None where it cannot read this PTX: Triton 3.9's PTX
    wants its ptxas-blackwell)."""
    ptxas = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "k.ptx"
        src.write_text(ptx)
        r = subprocess.run([str(ptxas), "-arch=sm_90a", "-v", str(src), "-o", str(Path(tmp) / "k.cubin")],
                           capture_output=True, text=True)
    m = re.search(r"Used (\d+) registers", r.stdout + r.stderr)
    return int(m.group(1)) if m else None


def programs_per_sm(regs: int | None, shared: int, warps: int) -> int | None:
    """Resident programs an sm90 multiprocessor holds: 64 warps, 32 programs, 64K registers (a warp's taken in
    units of 256, a thread's rounded up to 8), 228 KB of shared memory (1 KB of it reserved a program)."""
    if regs is None:
        return None
    per_warp = -(-(-(-regs // 8) * 8 * 32) // 256) * 256
    return min(64 // warps, 32, 65536 // (per_warp * warps), (228 * 1024) // (shared + 1024))


def fp8_buffers(ir: str) -> list[int]:
    """Depths of the fp8 tiles' shared buffers (the K and V tiles: local_alloc of memdesc<N x R x C x f8>)."""
    return sorted({int(n) for n in re.findall(r"local_alloc : \(\) -> !ttg.memdesc<(\d+)x\d+x\d+xf8E4M3FN", ir)})


def engine_loop(stages: int, prefetch: bool = False) -> dict:
    from kernels import prefill_attention

    jitted = prefill_attention._paged_attention_kernel.jitted()
    consts = {"GROUP": 4, "G_PACK": 4, "HEAD_CHUNKS": 1, "BLOCK_Q": 16, "BLOCK_M": 64, "BLOCK_N": 64,
              "HEAD_DIM": 128, "BLOCK_D": 128, "BLOCK_SIZE": 64, "HAS_WINDOW": False, "SPLIT": True,
              "PRECISION": None, "DOT_FP32": False, "WIDEN_F16": True, "QK_FP8": False, "V_T": True,
              "COMPACT": True, "BLOCK_B": prefill_attention.COMPACT_MAX_SEQS + 1, "PREFETCH": prefetch}
    sig = {n: PTRS.get(n, "i32") for n in jitted.arg_names if n not in consts} | dict.fromkeys(consts, "constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jitted.arg_names)
             if n not in consts and n not in NOT_DIV16}
    c = triton.compile(triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts, attrs=attrs),
                       target=TARGET, options={"num_warps": 4, "num_stages": stages})
    regs = registers(c.asm["ptx"])
    return {"case": f"prefill: engine loop, {stages} stages{', block ids a tile ahead' if prefetch else ''}",
            "kv_buffers": fp8_buffers(c.asm["ttgir"]),
            "registers": regs, "shared_bytes": c.metadata.shared,
            "programs_per_sm": programs_per_sm(regs, c.metadata.shared, 4)}


# decode_attention_triton's keywords per case: the engine's default, then gpu_run.sh dec_rate's variants
DECODE_CASES = {"default": {}, "n128": {"block_n": 128}, "s2": {"num_stages": 2}, "s4": {"num_stages": 4},
                "w4": {"num_warps": 4}, "n128_w4": {"block_n": 128, "num_warps": 4}, "nopf": {"prefetch": False}}
DECODE_PTRS = {"q_ptr": "*bf16", "k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv", "bt_ptr": "*i32",
               "seq_lens_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "out_ptr": "*bf16",
               "kn_ptr": "*bf16", "vn_ptr": "*bf16", "pos_ptr": "*i64", "cs_ptr": "*fp32", "slot_ptr": "*i64",
               "qk_scale": "fp32"}
# what the launcher specialises as 16-divisible (the compile test's list): pointers the cache tiles come through,
# and the strides
DECODE_DIV16 = {"q_ptr", "k_cache_ptr", "v_cache_ptr", "m_ptr", "l_ptr", "acc_ptr", "out_ptr", "kn_ptr", "vn_ptr",
                "cs_ptr", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "num_q_heads", "stride_qb",
                "stride_qh", "stride_cb", "stride_cs", "stride_ch", "stride_vcb", "stride_vch"}


def decode_loop(name: str, kw: dict) -> dict:
    from kernels import decode_attention

    jitted = decode_attention._decode_partial_kernel.jitted()
    bn, warps, stages = kw.get("block_n", 64), kw.get("num_warps", 2), kw.get("num_stages", 3)
    consts = {"GROUP": 4, "G_PACK": 4, "HEAD_CHUNKS": 1, "BLOCK_H": 16, "BLOCK_N": bn, "HEAD_DIM": 128,
              "BLOCK_D": 128, "BLOCK_SIZE": 64, "SPLIT": False, "HAS_WINDOW": False, "PRECISION": None,
              "DOT_FP32": False, "WIDEN_F16": True, "PREFETCH": kw.get("prefetch", True), "ROPE": False,
              "V_T": True, "V_MAX": 0.0}
    sig = {n: DECODE_PTRS.get(n, "i32") for n in jitted.arg_names if n not in consts} | dict.fromkeys(consts,
                                                                                                      "constexpr")
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(jitted.arg_names) if n in DECODE_DIV16}
    c = triton.compile(triton.compiler.ASTSource(fn=jitted, signature=sig, constexprs=consts, attrs=attrs),
                       target=TARGET, options={"num_warps": warps, "num_stages": stages})
    regs = registers(c.asm["ptx"])
    return {"case": f"decode: {name}", "kv_buffers": fp8_buffers(c.asm["ttgir"]), "registers": regs,
            "shared_bytes": c.metadata.shared, "programs_per_sm": programs_per_sm(regs, c.metadata.shared, warps)}


@triton.jit
def _tma_loop(q_ptr, k_desc, v_desc, bt_ptr, m_ptr, l_ptr, acc_ptr, ctx, n_new, stride_qt, stride_qh, num_splits,
              HK: tl.constexpr, GROUP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
              HEAD_DIM: tl.constexpr, WS: tl.constexpr, STAGES: tl.constexpr):
    # the engine loop's math, its K [keys, D] and keys-inner V^T [D, keys] tiles one cache block each, by TMA
    split = tl.program_id(0) % num_splits
    m_tile = tl.program_id(0) // num_splits
    kvh = tl.program_id(1)
    r = tl.arange(0, BLOCK_M)
    tok = m_tile * (BLOCK_M // GROUP) + r // GROUP
    qh = kvh * GROUP + r % GROUP
    ok = tok < n_new
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(q_ptr + tok[:, None].to(tl.int64) * stride_qt + qh[:, None] * stride_qh + d[None, :],
                mask=ok[:, None], other=0.0).to(tl.float16)
    qpos = ctx - n_new + tok
    tiles = tl.cdiv(ctx - n_new + tl.minimum((m_tile + 1) * (BLOCK_M // GROUP), n_new), BLOCK_N)
    m_i = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
    for t in tl.range(split * tiles // num_splits, (split + 1) * tiles // num_splits, warp_specialize=WS,
                      num_stages=STAGES):
        blk = tl.load(bt_ptr + t)
        k = k_desc.load([blk * BLOCK_N, kvh * HEAD_DIM])
        vt = v_desc.load([(blk * HK + kvh) * HEAD_DIM, 0])
        s = tl.dot(q, tl.trans(k.to(tl.float16)))
        kpos = t * BLOCK_N + tl.arange(0, BLOCK_N)
        s = tl.where(kpos[None, :] <= qpos[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.math.exp2(m_i - m_new)
        p = tl.math.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(tl.float16), tl.trans(vt.to(tl.float16)))
        m_i = m_new
    part = (tok.to(tl.int64) * (HK * GROUP) + qh) * num_splits + split
    tl.store(m_ptr + part, m_i, mask=ok)
    tl.store(l_ptr + part, l_i, mask=ok)
    tl.store(acc_ptr + part[:, None] * HEAD_DIM + d[None, :], acc, mask=ok[:, None])


def tma_loop(ws: bool, warps: int) -> dict:
    consts = {"HK": 8, "GROUP": 4, "BLOCK_M": 64, "BLOCK_N": 64, "HEAD_DIM": 128, "WS": ws, "STAGES": 3}
    sig = {"q_ptr": "*bf16", "k_desc": "tensordesc<fp8e4nv[64, 128]>", "v_desc": "tensordesc<fp8e4nv[128, 64]>",
           "bt_ptr": "*i32", "m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32", "ctx": "i32", "n_new": "i32",
           "stride_qt": "i32", "stride_qh": "i32", "num_splits": "i32"} | dict.fromkeys(consts, "constexpr")
    case = f"prefill: TMA loop, warp_specialize={ws}, {warps} warps"
    # (a failed pass can abort the process from C++: each case runs in its own)
    code = (f"import sys; sys.path.insert(0, {str(Path(__file__).resolve().parent)!r}); import probe_attention_sm90 as p, "
            f"triton, json; c = triton.compile(triton.compiler.ASTSource(fn=p._tma_loop, signature={sig!r}, "
            f"constexprs={consts!r}), target=p.TARGET, options={{'num_warps': {warps}, 'num_stages': 3}}); "
            "ir = c.asm['ttgir']; print(json.dumps({'partitions': ir.count('ttg.warp_specialize'), "
            "'tma_copies': c.asm['ptx'].count('cp.async.bulk.tensor')}))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    if r.returncode != 0:
        tail = [ln for ln in r.stderr.splitlines() if "Assertion" in ln or "error:" in ln][:1]
        return {"case": case, "compiled": False, "why": (tail or r.stderr.splitlines()[-1:] or ["?"])[0][-240:]}
    return {"case": case, "compiled": True, **json.loads(r.stdout.strip().splitlines()[-1])}


def main() -> None:
    print(json.dumps({"triton": triton.__version__}))
    for stages in (2, 3, 4):
        print(json.dumps(engine_loop(stages)), flush=True)
    for stages in (3, 4):  # paged_attention_triton(prefetch=True): at least 3 stages
        print(json.dumps(engine_loop(stages, prefetch=True)), flush=True)
    for ws, warps in ((False, 4), (True, 4), (True, 8)):
        print(json.dumps(tma_loop(ws, warps)), flush=True)
    for name, kw in DECODE_CASES.items():
        print(json.dumps(decode_loop(name, kw)), flush=True)


if __name__ == "__main__":
    main()
