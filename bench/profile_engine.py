"""Where a step's time goes: CPU dispatch vs GPU time, and the top GPU kernels, per TTFT/decode case.

    python3 bench/profile_engine.py            # llama3-8b shape, random bf16 weights
    python3 bench/profile_engine.py --quantization fp8 --kv-cache-dtype fp8 --cases "ttft 2048c+128,ttft 2048"
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine

ONE = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
rng = random.Random(0)


def ids(n: int) -> list[int]:
    return [rng.randrange(1000, 120000) for _ in range(n)]


def first_token(engine: LLMEngine, rid: str, prompt: list[int]) -> None:
    engine.add_request(rid, prompt_token_ids=prompt, sampling=ONE)
    while engine.has_unfinished():
        engine.step()


def dispatch_ms(engine: LLMEngine, prompt: list[int]) -> tuple[float, float]:
    """(CPU ms to issue the forward, wall ms to the synced result) for one prefill step."""
    r = engine.runner
    engine.add_request("disp", prompt_token_ids=prompt, sampling=ONE)
    out = engine.scheduler.schedule()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    input_ids, positions, meta, _rows = r.prepare(out)
    t_prep = time.perf_counter()
    with torch.inference_mode():
        _hidden, _residual = r.model(input_ids, positions, r.cos_sin, r.kv_caches, meta)
        t_issue = time.perf_counter()
        torch.cuda.synchronize()
    t_done = time.perf_counter()
    engine.abort("disp")
    engine.step()
    return ((t_prep - t0) * 1e3, (t_issue - t_prep) * 1e3, (t_done - t0) * 1e3)


def timeline(prof, marker: str) -> str:
    """GPU busy vs idle inside the CPU span of record_function(marker): lead (before the first
    kernel), tail (after the last), and the largest idle gaps with the CPU op running then."""
    from torch.autograd import DeviceType

    evs = prof.events()
    span = next((e for e in evs if e.name == marker), None)
    if span is None:
        return f"(no span {marker})"
    t0, t1 = span.time_range.start, span.time_range.end
    # the GPU's own events; not record_function's mirror on the GPU timeline (a "gpu_user_annotation"
    # spanning the marker's kernels, which counted every gap inside it as busy until e.g. 46.5 ms of
    # "busy" held 25.6 ms of kernels in a 2048-token prefill)
    ks = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs
                if e.device_type == DeviceType.CUDA and t0 <= e.time_range.start <= t1
                and not getattr(e, "is_user_annotation", False) and e.name != marker)
    if not ks:
        return "(no kernels)"
    cpu = [e for e in evs if e.device_type == DeviceType.CPU and e.name != marker]
    busy, gaps, end = 0.0, [], ks[0][0]
    for a, b, name in ks:
        if a > end:
            gaps.append((a - end, end, name))
        busy += max(0.0, b - max(a, end))
        end = max(end, b)
    gaps.sort(reverse=True)
    lines = [f"wall {(t1 - t0) / 1e3:.2f} ms: GPU busy {busy / 1e3:.2f} ms, lead {(ks[0][0] - t0) / 1e3:.2f} ms, "
             f"tail {(t1 - end) / 1e3:.2f} ms, idle gaps {sum(g for g, _, _ in gaps) / 1e3:.2f} ms in {len(gaps)}"]
    for g, at, nxt in gaps[:6]:
        running = [e.name for e in cpu if e.time_range.start <= at <= e.time_range.end][-3:]
        lines.append(f"  gap {g:.0f} us before {nxt[:50]} (CPU in {running})")
    return "\n".join(lines)


class HostClock:
    """Wall time inside named host functions (wrapped on their objects) over many requests: where a
    first token's time outside the GPU's kernels goes. Nested spans each count their own total (a
    replay inside execute counts in both); `device` sums the steps' CUDA-event time."""

    def __init__(self) -> None:
        self.spent: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.device = 0.0
        self._undo: list[tuple[object, str, object]] = []

    def wrap(self, obj: object, attr: str, name: str | None = None) -> None:
        fn = getattr(obj, attr)
        label = name or attr

        def timed(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.spent[label] = self.spent.get(label, 0.0) + time.perf_counter() - t0
                self.calls[label] = self.calls.get(label, 0) + 1

        self._undo.append((obj, attr, obj.__dict__.get(attr) if hasattr(obj, "__dict__") else None))
        setattr(obj, attr, timed)

    def restore(self) -> None:
        for obj, attr, old in reversed(self._undo):
            if old is None:
                delattr(obj, attr)
            else:
                setattr(obj, attr, old)
        self._undo.clear()


def host_breakdown(eng: LLMEngine, make_prompt, n: int = 20) -> str:
    """Per request (mean of n, after 3 untimed): wall to the first token on the host against the
    step's CUDA-event time and the host spans (add_request, schedule, execute and its parts, read-back
    and its wait for the device); then cProfile's top functions by own time over n more."""
    import cProfile
    import io
    import pstats

    from workers.engine import cuda_graphs, model_runner
    from workers.engine.sampled import SampledTokens

    for i in range(3):
        first_token(eng, f"hb-w{i}", make_prompt())
    clock = HostClock()
    r = eng.runner
    clock.wrap(eng, "add_request")
    clock.wrap(eng.scheduler, "schedule")
    clock.wrap(eng.scheduler.kv, "allocate_slots")
    clock.wrap(r, "execute")
    for attr in ("graphs", "prefill_graphs", "mixed_graphs"):
        if getattr(r, attr) is not None:
            clock.wrap(getattr(r, attr), "run", f"{attr}.run")
    clock.wrap(cuda_graphs, "host_batch")
    clock.wrap(model_runner, "host_batch", "host_batch (eager)")
    if torch.cuda.is_available():
        clock.wrap(torch.cuda.CUDAGraph, "replay", "CUDAGraph.replay")
    clock.wrap(r, "sampler")
    clock.wrap(r, "sampling_batch")
    clock.wrap(eng, "_launched")
    clock.wrap(eng, "_read_back")
    clock.wrap(SampledTokens, "tolist", "tolist (waits for the device)")
    seconds = SampledTokens.device_seconds

    def device_seconds(self):  # the step's CUDA-event time, summed
        sec = seconds(self)
        clock.device += sec or 0.0
        return sec

    SampledTokens.device_seconds = device_seconds
    walls = []
    try:
        for i in range(n):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            rid = f"hb-{i}"
            eng.add_request(rid, prompt_token_ids=make_prompt(), sampling=ONE)
            while True:
                res = eng.step()
                if any(e.request_id == rid for e in res.first_tokens):
                    break
            walls.append((time.perf_counter() - t0) * 1e3)
            while eng.has_unfinished():
                eng.step()
    finally:
        clock.restore()
        SampledTokens.device_seconds = seconds
    lines = [f"wall to first token: median {statistics.median(walls):.3f} ms, min {min(walls):.3f}, "
             f"max {max(walls):.3f} over {n}; the steps' CUDA-event time {clock.device / n * 1e3:.3f} ms a request"]
    for k in sorted(clock.spent, key=lambda k: -clock.spent[k]):
        lines.append(f"  {k:<34} {clock.spent[k] / n * 1e3:8.3f} ms a request ({clock.calls[k] / n:.1f} calls)")
    prof = cProfile.Profile()
    prof.enable()
    for i in range(n):
        first_token(eng, f"hb-p{i}", make_prompt())
    prof.disable()
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(25)
    lines.append(f"cProfile over {n} requests (its own overhead included), by own time:")
    lines.append(buf.getvalue())
    return "\n".join(lines)


def show(prof, title: str, n: int = 12) -> None:
    print(f"\n## {title}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=n, max_name_column_width=60))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quantization", default=None, choices=["fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--cases", default="ttft 512,ttft 2048c+128,ttft 2048,ttft 8192,ttft 32768",
                    help="comma-separated TTFT cases to profile (the decode batches follow)")
    ap.add_argument("--decode-batches", default="1", help="comma-separated decode batch sizes to profile")
    ap.add_argument("--decode-prompt-len", type=int, default=512,
                    help="prompt tokens of each decode sequence (~1500: the throughput shape's mean context)")
    ap.add_argument("--rows", type=int, default=12, help="kernels listed per case")
    ap.add_argument("--trace", default="", help="a folder: each case's profile as a gzipped Chrome trace there")
    ap.add_argument("--host", default="", help="comma-separated TTFT cases to break down on the host "
                    "(HostClock spans and cProfile; e.g. 'ttft 2048c+128')")
    ap.add_argument("--max-num-seqs", type=int, default=512, help="the engine's (and its decode graphs') batch bound")
    ap.add_argument("--max-model-len", type=int, default=33024)
    args = ap.parse_args()
    eng = LLMEngine("llama3-8b", EngineConfig(max_model_len=args.max_model_len, max_num_batched_tokens=32768,
                                               max_num_seqs=args.max_num_seqs,
                                               gpu_memory_utilization=0.9, quantization=args.quantization,
                                               kv_cache_dtype=args.kv_cache_dtype))
    print(f"quantization {args.quantization}, kv cache {args.kv_cache_dtype}", flush=True)
    for n in (600, 600):
        first_token(eng, f"w{n}-{rng.random()}", ids(n))
    print("prepare/issue/total ms for a 512-token prefill:", dispatch_ms(eng, ids(512)))
    print("prepare/issue/total ms for a 128-token prefill:", dispatch_ms(eng, ids(128)))
    prefix = ids(2048)
    first_token(eng, "pw", prefix)
    cases = {"ttft 512": ids(512), "ttft 2048c+128": prefix + ids(128), "ttft 2048": ids(2048),
             "ttft 8192": ids(8192), "ttft 32768": ids(32768)}
    cases = {k: v for k, v in cases.items() if k in args.cases.split(",")}
    for name in (c for c in args.host.split(",") if c):
        n = int(name.split()[1].split("c")[0]) if "c+" not in name else 128
        print(f"\n## host breakdown, {name}")
        print(host_breakdown(eng, (lambda: prefix + ids(128)) if "c+" in name else (lambda n=n: ids(n))), flush=True)
    for name, prompt in cases.items():
        walls = []
        for i in range(3):  # unprofiled; a cached prefix stays cached, the rest is new each time
            p = prefix + ids(128) if "c+" in name else ids(len(prompt))
            t0 = time.perf_counter()
            first_token(eng, f"{name}-{i}", p)
            walls.append((time.perf_counter() - t0) * 1e3)
        prompt = prefix + ids(128) if "c+" in name else ids(len(prompt))
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            with torch.profiler.record_function("case"):
                t0 = time.perf_counter()
                first_token(eng, name, prompt)
                torch.cuda.synchronize()
            wall = (time.perf_counter() - t0) * 1e3
        show(prof, f"{name}: wall {wall:.1f} ms (profiled), unprofiled {[round(w, 2) for w in walls]} ms", args.rows)
        print(timeline(prof, "case"), flush=True)
        if args.trace:
            import gzip
            import shutil
            import tempfile

            Path(args.trace).mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
                prof.export_chrome_trace(tmp.name)
                with open(tmp.name, "rb") as src, gzip.open(Path(args.trace, f"{name.replace(' ', '_')}.json.gz"), "wb") as dst:
                    shutil.copyfileobj(src, dst)
    for b in (int(x) for x in args.decode_batches.split(",") if x):  # "": no decode case
        # long enough that the first prompts still decode when the last one's prefill is done
        sp = SamplingParams(max_tokens=40 + b * args.decode_prompt_len // 8192, temperature=0.0, ignore_eos=True)
        for i in range(b):
            eng.add_request(f"d{b}-{i}", prompt_token_ids=ids(args.decode_prompt_len), sampling=sp)
        for _ in range(3):
            eng.step()
        while (eng.scheduler.waiting or len(eng.scheduler.running) < b
               or any(r.num_computed_tokens < r.num_prompt_tokens for r in eng.scheduler.running)):
            if len(eng.scheduler.waiting) + len(eng.scheduler.running) < b:  # one ended: they never all decode
                sys.exit(f"decode b{b}: a sequence ended before all {b} decoded at once (preempted for room: "
                         f"the KV pool holds {eng.kv.pool.num_blocks} blocks); take a smaller batch")
            eng.step()  # until every sequence decodes: a profiled step is a decode step
        for _ in range(3):
            eng.step()
        with (profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof,
              torch.profiler.record_function("case")):
            for _ in range(5):
                eng.step()
            torch.cuda.synchronize()
        show(prof, f"decode b{b} at {args.decode_prompt_len}+ tokens, 5 steps, graphs on (path {eng.runner.last_path})", args.rows)
        print(timeline(prof, "case"), flush=True)
        while eng.has_unfinished():
            eng.step()


if __name__ == "__main__":
    main()
