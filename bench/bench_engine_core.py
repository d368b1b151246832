"""How long a worker thread woken by the network waits while the engine runs: the engine core on
a thread of the worker's process (the GIL shared) or in its own process (workers.engine_core).

The engine is kept busy decoding `--running` sequences (each finished one is replaced). A child
process sends its monotonic clock over a socket every `--every-ms`; a thread of this process,
blocked on the socket like the Kafka consumer's IO thread, records when it got each one. That
delay is what every Kafka fetch response waits before the worker can read it. Also reported:
the engine's generation throughput in each mode (the engine's own Python, unshared or shared).

    python3 bench/bench_engine_core.py --model llama3-8b --seconds 20      # on the GPU
    python bench/bench_engine_core.py --model tiny --device cpu --running 32 --seconds 10

Prints a JSON line per mode and a markdown table.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine
from workers.engine_core import AddRequest, InThreadCore, ProcessCore


def pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * (len(s) - 1) + 0.5))] if s else float("nan")


def _ticker(sock: socket.socket, every_s: float, seconds: float) -> None:
    """Child process: send the monotonic clock every `every_s` for `seconds`."""
    end = time.monotonic() + seconds
    nxt = time.monotonic()
    while time.monotonic() < end:
        nxt += every_s
        time.sleep(max(0.0, nxt - time.monotonic()))
        sock.sendall(struct.pack("d", time.monotonic()))
    sock.close()


def run_mode(mode: str, args: argparse.Namespace) -> dict:
    cfg = EngineConfig(device=args.device, max_num_seqs=max(args.running, 1))
    engine = None  # the in-thread core's engine: closed after the run, so the next mode gets its memory
    if mode == "process":
        core = ProcessCore(args.model, cfg, torch_threads=args.torch_threads)
    else:
        if args.torch_threads:
            import torch

            torch.set_num_threads(args.torch_threads)
        engine = LLMEngine(args.model, cfg)
        core = InThreadCore(engine)
    core.start()
    prompt = "the quick brown fox jumps over the lazy dog " * (args.prompt_len // 44 + 1)
    n = 0

    def sampling(i: int) -> SamplingParams:
        # lengths spread over [max_tokens/2, 3*max_tokens/2): sequences finish (and are replaced)
        # a few at a time, not in waves of `running` at once that a window would catch 3 or 4 of
        length = args.max_tokens // 2 + (i * 7919) % args.max_tokens
        return SamplingParams(max_tokens=length, temperature=0.0, ignore_eos=True)

    def submit(k: int) -> None:
        nonlocal n
        core.submit(
            [AddRequest(f"{mode}{n + i}", f"{n + i} {prompt}"[: args.prompt_len], None, sampling(n + i)) for i in range(k)]
        )
        n += k

    tokens = 0
    steps: list[tuple[float, int, float]] = []  # (when it arrived, steps, step_seconds) of each stats
    stop = threading.Event()

    def results() -> None:  # the worker's results thread: replace each finished sequence
        nonlocal tokens
        while not stop.is_set():
            out = core.get(0.05)
            if out is not None and out.stats is not None:
                steps.append((time.monotonic(), out.stats.steps, out.stats.step_seconds))
            if out is not None and out.finished:
                tokens += sum(len(f.output_token_ids) for f in out.finished)
                submit(len(out.finished))

    submit(args.running)
    reader = threading.Thread(target=results, daemon=True)
    reader.start()
    time.sleep(args.warmup_s)  # prefills done, decoding steadily
    t0, tok0 = time.monotonic(), tokens
    a, b = socket.socketpair()
    ctx = multiprocessing.get_context("spawn")
    tick = ctx.Process(target=_ticker, args=(b, args.every_ms / 1e3, args.seconds))
    tick.start()
    b.close()
    delays: list[float] = []
    buf = b""
    while True:
        chunk = a.recv(4096)
        now = time.monotonic()
        if not chunk:
            break
        buf += chunk
        while len(buf) >= 8:
            (sent,) = struct.unpack("d", buf[:8])
            buf = buf[8:]
            delays.append((now - sent) * 1e3)
    dt = time.monotonic() - t0
    gen = tokens - tok0
    # steps per second between the first and the last stats of the window
    window = [w for w in steps if t0 <= w[0] <= t0 + dt]
    steps_per_s = step_ms = float("nan")
    if len(window) > 1 and window[-1][1] > window[0][1]:
        (ta, ka, sa), (tb, kb, sb) = window[0], window[-1]
        steps_per_s = (kb - ka) / (tb - ta)
        step_ms = (sb - sa) / (kb - ka) * 1e3  # inside engine.step(); the rest of 1/steps_per_s is the loop's
    tick.join()
    stop.set()
    reader.join()
    t_stop = time.monotonic()
    core.stop()
    stop_s = time.monotonic() - t_stop
    if engine is not None:
        engine.close()
    return {
        "mode": mode,
        "wake_ms": {"p50": pct(delays, 0.5), "p90": pct(delays, 0.9), "p99": pct(delays, 0.99), "max": max(delays)},
        "wakes": len(delays),
        "generated_tokens_per_s": gen / dt,
        "steps_per_s": steps_per_s,
        "step_ms": step_ms,
        "stop_s": stop_s,  # core.stop() with `running` sequences in flight
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3-8b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--running", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--warmup-s", type=float, default=5.0)
    ap.add_argument("--every-ms", type=float, default=5.0)
    ap.add_argument("--modes", default="thread,process")
    ap.add_argument("--torch-threads", type=int, default=None, help="torch intra-op threads of a CPU engine")
    args = ap.parse_args()
    commit = os.environ.get("FIRSTTOKEN_COMMIT") or subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    rows = []
    for mode in args.modes.split(","):
        r = run_mode(mode, args)
        # the in-thread engine's device memory goes back before the next mode's engine is built
        # (a process core started after it ran out of memory)
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        r.update(model=args.model, running=args.running, commit=commit, date=time.strftime("%Y-%m-%d %H:%M"))
        print(json.dumps(r), flush=True)
        rows.append(r)
    print("\n| engine core | wake p50 | p90 | p99 | max | generated tok/s | steps/s | in step() | stop |\n"
          "|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        w = r["wake_ms"]
        print(f"| {r['mode']} | {w['p50']:.3f} ms | {w['p90']:.3f} | {w['p99']:.3f} | {w['max']:.2f} | "
              f"{r['generated_tokens_per_s']:.0f} | {r['steps_per_s']:.1f} | {r['step_ms']:.2f} ms | {r['stop_s']:.1f} s |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
