"""TTFT 2048 cached + 128's attention, one layer of Llama-3.1-8B heads (32 q, 8 kv, D 128): 128 new tokens
over a 2176-token context in the paged fp8 cache (block 16, blocks shuffled). The engine's Triton paged
prefill kernel against cuDNN's attention through its frontend, each captured in a CUDA graph and replayed
(the prefill graph's way; no host time), in one run:

- `triton paged`: kernels.prefill_attention.paged_attention_triton (bf16 q, the fp8 cache widened);
- `cudnn fp8 paged`: sdpa_fp8 reading K/V through the block table (q cast to e4m3, O in e4m3);
- `cudnn fp8 gathered`: the sequence's K/V gathered into contiguous tensors first, then sdpa_fp8;
- `cudnn bf16 gathered`: the same in bf16 (the bf16 engine's case), K/V widened.

Causal masks are bottom-right aligned (the new tokens are the context's last). Errors: relative RMS against
fp32 attention over the cache's values (kernels.prefill_attention.paged_attention_ref).

    python3 bench/bench_cached_attention.py [--cached 2048 --new 128]

On the H200 (bench/results/2026-12-03-profile-fp8-h200-b9352b7.txt) the Triton kernel and its split
combine took 1.13 ms of the FP8 engine's 5.67 ms of GPU time for this TTFT (32 layers); the target is 4.5.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bench_fp8_decode import chain_us
from bench.common import header, md_table, write_report
from kernels import cudnn_attention as ca

HQ, HK, D, BS = 32, 8, 128, 16
SCALE = D**-0.5


def graph_us(fn, reps: int = 50) -> float:
    """Median µs of one call of fn, ten calls captured back to back in one CUDA graph and replayed."""
    return chain_us(fn, [()] * 10, reps)


class CudnnAttention:
    """One cuDNN sdpa graph over q [Tq, Hq, D] and a sequence's K/V: paged (the cache and a block table)
    or gathered ([Tkv, Hk, D]); fp8 (e4m3 in and out, scales) or bf16."""

    def __init__(self, tq: int, tkv: int, fp8: bool, paged: bool, num_blocks: int, max_blocks: int) -> None:
        import cudnn

        self.fp8, self.paged = fp8, paged
        self.handle = ca._handle(torch.device("cuda"))
        io = cudnn.data_type.FP8_E4M3 if fp8 else cudnn.data_type.BFLOAT16
        f32, i32 = cudnn.data_type.FLOAT, cudnn.data_type.INT32
        g = cudnn.pygraph(io_data_type=io, intermediate_data_type=f32, compute_data_type=f32, handle=self.handle)
        self.q = g.tensor(name="q", dim=[1, HQ, tq, D], stride=[tq * HQ * D, D, HQ * D, 1], data_type=io)
        kw: dict = {"attn_scale": SCALE, "use_causal_mask_bottom_right": True, "name": "sdpa"}
        if paged:  # the cache [num_blocks, BS, Hk, D] seen as [num_blocks, Hk, BS, D]
            dims, strides = [num_blocks, HK, BS, D], [BS * HK * D, D, HK * D, 1]
            self.table = g.tensor(name="table", dim=[1, 1, max_blocks, 1], stride=[max_blocks, max_blocks, 1, 1],
                                  data_type=i32)
            self.seq_q = g.tensor(name="seq_q", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
            self.seq_kv = g.tensor(name="seq_kv", dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=i32)
            kw.update(use_padding_mask=True, seq_len_q=self.seq_q, seq_len_kv=self.seq_kv,
                      paged_attention_k_table=self.table, paged_attention_v_table=self.table,
                      paged_attention_max_seq_len_kv=max_blocks * BS)
        else:
            dims, strides = [1, HK, tkv, D], [tkv * HK * D, D, HK * D, 1]
        self.k = g.tensor(name="k", dim=dims, stride=strides, data_type=io)
        self.v = g.tensor(name="v", dim=dims, stride=strides, data_type=io)
        if fp8:
            self.sc = [g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32)
                       for n in ("dq", "dk", "dv", "ds", "ss", "so")]
            o, _, amax_s, amax_o = g.sdpa_fp8(q=self.q, k=self.k, v=self.v, descale_q=self.sc[0],
                                              descale_k=self.sc[1], descale_v=self.sc[2], descale_s=self.sc[3],
                                              scale_s=self.sc[4], scale_o=self.sc[5], is_inference=True, **kw)
            for a in (amax_s, amax_o):
                a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
            self.amax = (amax_s, amax_o)
        else:
            o, _ = g.sdpa(q=self.q, k=self.k, v=self.v, is_inference=True, **kw)
        o.set_output(True).set_dim([1, HQ, tq, D]).set_stride([tq * HQ * D, D, HQ * D, 1]).set_data_type(io)
        self.o = o
        g.validate()
        g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans()
        self.g = g
        self.ws = torch.empty(max(g.get_workspace_size(), 1), dtype=torch.uint8, device="cuda")
        self.consts = torch.tensor([1.0, 1.0, 1.0, 1.0 / ca.P_SCALE, ca.P_SCALE, 0.0, 0.0], device="cuda")

    def __call__(self, q, k, v, out, o_scale=None, table=None, seq_q=None, seq_kv=None) -> torch.Tensor:
        import cudnn

        pack = {self.q: q, self.k: k, self.v: v, self.o: out}
        if self.fp8:
            c = self.consts
            pack.update({self.sc[0]: c[0:1], self.sc[1]: c[1:2], self.sc[2]: c[2:3], self.sc[3]: c[3:4],
                         self.sc[4]: c[4:5], self.sc[5]: o_scale, self.amax[0]: c[5:6], self.amax[1]: c[6:7]})
        if self.paged:
            pack.update({self.table: table, self.seq_q: seq_q, self.seq_kv: seq_kv})
        cudnn.set_stream(handle=self.handle, stream=torch.cuda.current_stream().cuda_stream)
        self.g.execute(pack, self.ws, handle=self.handle)
        return out


def main() -> None:
    from kernels.fp8_quant import cast_e4m3_triton
    from kernels.prefill_attention import paged_attention_ref, paged_attention_triton

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cached", type=int, default=2048)
    ap.add_argument("--new", type=int, default=128)
    args = ap.parse_args()
    tq, tkv = args.new, args.cached + args.new
    nb_seq = -(-tkv // BS)
    num_blocks = 4096
    g = torch.Generator(device="cuda").manual_seed(0)
    k_cache = torch.randn((num_blocks, BS, HK, D), device="cuda", generator=g).to(torch.float8_e4m3fn)
    v_cache = (0.5 * torch.randn((num_blocks, BS, HK, D), device="cuda", generator=g)).to(torch.float8_e4m3fn)
    blocks = torch.randperm(num_blocks, device="cuda", generator=g)[:nb_seq].to(torch.int32)
    table = blocks[None].contiguous()  # [1, nb_seq]
    q = (2.0 * torch.randn((tq, HQ, D), device="cuda", generator=g)).to(torch.bfloat16)
    qsl = torch.tensor([0, tq], dtype=torch.int32, device="cuda")
    seq_lens = torch.tensor([tkv], dtype=torch.int32, device="cuda")
    ref = paged_attention_ref(q.float(), k_cache, v_cache, table, qsl, seq_lens, SCALE).float()
    vmax = float(v_cache.float().abs().max())
    o_scale = torch.tensor([ca.FP8_MAX / (ca.O_MARGIN * vmax)], device="cuda")
    seq_q = torch.tensor([tq], dtype=torch.int32, device="cuda").reshape(1, 1, 1, 1)
    seq_kv = torch.tensor([tkv], dtype=torch.int32, device="cuda").reshape(1, 1, 1, 1)
    q8buf = torch.empty((tq, HQ * D), dtype=torch.float8_e4m3fn, device="cuda")
    o8 = torch.empty((tq, HQ, D), dtype=torch.float8_e4m3fn, device="cuda")
    obf = torch.empty((tq, HQ, D), dtype=torch.bfloat16, device="cuda")
    flat_k = k_cache.view(num_blocks * BS, HK, D)
    flat_v = v_cache.view(num_blocks * BS, HK, D)
    slots = (blocks.long()[:, None] * BS + torch.arange(BS, device="cuda")).reshape(-1)[:tkv]

    def cast_q():
        cast_e4m3_triton(q.view(tq, HQ * D), HQ * D, ca.O_MARGIN, out=q8buf)
        return q8buf.view(tq, HQ, D)

    variants = {"triton paged": (lambda: paged_attention_triton(q, k_cache, v_cache, table, qsl, seq_lens, SCALE,
                                                                max_query_len=tq), None)}
    builders = {
        "cudnn fp8 paged": lambda: CudnnAttention(tq, tkv, True, True, num_blocks, nb_seq),
        "cudnn fp8 gathered": lambda: CudnnAttention(tq, tkv, True, False, num_blocks, nb_seq),
        "cudnn bf16 gathered": lambda: CudnnAttention(tq, tkv, False, False, num_blocks, nb_seq),
    }
    rows = []
    for name, build in builders.items():
        try:
            att = build()
        except Exception as e:  # a graph cuDNN refuses is a result
            rows.append({"variant": name, "error": f"{type(e).__name__}: {str(e)[:300]}"})
            print(rows[-1], flush=True)
            continue
        if name == "cudnn fp8 paged":
            variants[name] = (lambda att=att: att(cast_q(), k_cache, v_cache, o8, o_scale, table[:, None, :, None],
                                                  seq_q, seq_kv), o_scale)
        elif name == "cudnn fp8 gathered":
            variants[name] = (lambda att=att: att(cast_q(), flat_k[slots], flat_v[slots], o8, o_scale), o_scale)
        else:
            variants[name] = (lambda att=att: att(q, flat_k[slots].to(torch.bfloat16), flat_v[slots].to(torch.bfloat16),
                                                  obf), None)
    for name, (fn, osc) in variants.items():
        row = {"variant": name}
        try:
            o = fn()
            torch.cuda.synchronize()
            of = o.float() if osc is None else o.float() / osc
            row["rel_err"] = round(float((of - ref).norm() / ref.norm()), 5)
            row["us_graph"] = round(graph_us(fn), 2)
        except Exception as e:  # a variant that fails is a result
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(row, flush=True)
        rows.append(row)
    info = {**header(), "cached": args.cached, "new": args.new}
    write_report("cached_attention", {**info, "rows": rows}, md_table(rows, ["variant", "us_graph", "rel_err", "error"]))


if __name__ == "__main__":
    main()
