"""What guided decoding costs a decode step: TPOT at a batch with every row under a grammar against
the same batch unguided, in the same run, and the host's time filling the masks per step (which
runs while the device computes the step's forward: it costs TPOT only where it outlasts it).

The model is a preset's shape with random weights (Llama-3.1-8B by default), its tokenizer a real
one (SmolLM2-135M's 49k tokens: the masks' cost depends on the vocabulary, and a random preset's
byte-level tokenizer has 258). Every row asks for a JSON object (json_object), or a schema, and
decodes `--steps` tokens; rows whose grammar ends early are replaced, so the batch stays full, and
only the steps with no prompt chunk in them (pure decode steps) are timed.

    python3 bench/bench_guided.py [--preset llama3-8b] [--batch 64] [--quantization fp8] [--tokenizer DIR]
    python3 bench/bench_guided.py --device cpu --preset tiny --tokenizer preset --batch 8 --steps 12  # smoke

On the GPU machine (no network): copy SmolLM2's tokenizer.json and tokenizer_config.json here into
.tok/ (the directory `python3 -c "from workers.engine.downloads import ensure_model as e;
print(e('smollm2-135m'))"` prints), add /.tok/ to .git/info/exclude, carry .tok with the wheels
(.whl must hold llguidance's: pip download --no-deps --only-binary=:all: --python-version 3.12
--platform manylinux_2_31_x86_64 -d .whl llguidance) and run `bench/gpu_run.sh guided`.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import header, md_table, write_report
from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine
from workers.engine.tokenizer import Tokenizer

SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "year": {"type": "integer"}, "tags": {"type": "array", "items": {"type": "string"}},
    "rating": {"type": "number"}, "notes": {"type": "string"}},
    "required": ["title", "year", "tags", "rating", "notes"], "additionalProperties": False}


def tokenizer_dir(arg: str | None) -> Path:
    if arg:
        return Path(arg)
    from workers.engine.downloads import ensure_model

    return ensure_model("smollm2-135m")


def run(eng: LLMEngine, batch: int, steps: int, prompt_len: int, guided: dict | None, vocab: int,
        tag: str) -> dict:
    """Decode `steps` steps with `batch` rows running; per-step wall times of the steady part and
    the host's mask time per step."""
    rng = random.Random(0)
    sp = SamplingParams(max_tokens=steps + 20, temperature=1.0, seed=1, ignore_eos=guided is None, guided=guided)
    mask_s: list[float] = []
    inner = eng._guide_masks

    def timed(reqs, prev, result):
        t0 = time.perf_counter()
        out = inner(reqs, prev, result)
        mask_s.append(time.perf_counter() - t0)
        return out

    eng._guide_masks = timed  # type: ignore[method-assign]
    n = 0

    def add() -> None:
        nonlocal n
        eng.add_request(f"{tag}{n}", prompt_token_ids=[rng.randrange(100, vocab) for _ in range(prompt_len)],
                        sampling=sp)
        n += 1

    for _ in range(batch):
        add()
    walls, ended = [], 0
    for i in range(steps + 10):
        t0 = time.perf_counter()
        out = eng.step()
        if i >= 5 and out.num_batched_tokens == out.num_scheduled:  # a decode step (no prompt chunk in it)
            walls.append(time.perf_counter() - t0)
        for _ in out.finished:  # keep the batch full
            ended += 1
            add()
    while eng.has_unfinished():
        for r in list(eng.requests):
            eng.abort(r)
        eng.step()
    eng._guide_masks = inner  # type: ignore[method-assign]
    steady = walls
    return {"tpot_ms": 1e3 * statistics.median(steady), "tpot_p90_ms": 1e3 * sorted(steady)[int(0.9 * len(steady))],
            "mask_host_ms": 1e3 * statistics.median(mask_s) if mask_s else 0.0,
            "mask_host_p90_ms": 1e3 * sorted(mask_s)[int(0.9 * len(mask_s))] if mask_s else 0.0,
            "rows_ended": ended, "decode_steps": len(steady)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="llama3-8b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--quantization", default=None, choices=[None, "fp8"])
    ap.add_argument("--kv-cache-dtype", default="auto")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--tokenizer", default=None,
                    help="a directory with tokenizer.json (default: SmolLM2-135M's); 'preset': the preset's own")
    args = ap.parse_args()
    tok = None if args.tokenizer == "preset" else Tokenizer.from_dir(tokenizer_dir(args.tokenizer))
    cfg = EngineConfig(max_num_seqs=max(args.batch, 8), max_model_len=args.prompt_len + args.steps + 64,
                       device=args.device, quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
    eng = LLMEngine(args.preset, cfg, tokenizer=tok)
    vocab = eng.tokenizer.vocab_size
    t0 = time.perf_counter()
    eng._grammar_compiler()  # the vocabulary indexed once per engine, before any timing
    index_s = time.perf_counter() - t0
    run(eng, args.batch, 8, args.prompt_len, None, vocab, "warm")  # compiles, graphs
    rows = []
    import workers.engine.engine as engine_mod

    parallel = engine_mod.PARALLEL_MASKS
    schema = {"kind": "json_schema", "json_schema": SCHEMA}
    for name, guided, par in (("none", None, parallel), ("json_object", {"kind": "json_object"}, parallel),
                              ("json_schema", schema, parallel), ("json_schema, masks in one thread", schema, 10**9),
                              ("none (again)", None, parallel)):
        engine_mod.PARALLEL_MASKS = par  # rows from which a CUDA step fills its masks in llguidance's pool
        r = run(eng, args.batch, args.steps, args.prompt_len, guided, vocab, name.split()[0][:4] + str(len(rows)))
        rows.append({"guided": name, **r})
        print(rows[-1], flush=True)
    engine_mod.PARALLEL_MASKS = parallel
    base = statistics.mean(r["tpot_ms"] for r in rows if r["guided"].startswith("none"))
    for r in rows:
        r["overhead_pct"] = 100.0 * (r["tpot_ms"] / base - 1.0)
    data = {**header(), "bench": "guided", "preset": args.preset, "quantization": args.quantization,
            "batch": args.batch, "steps": args.steps, "tokenizer_vocab": vocab, "vocab_index_s": index_s,
            "async_scheduling": eng.async_scheduling, "rows": rows}
    md = md_table(rows, ["guided", "tpot_ms", "tpot_p90_ms", "overhead_pct", "mask_host_ms", "mask_host_p90_ms",
                         "rows_ended", "decode_steps"])
    write_report(f"bench_guided_{args.preset}_b{args.batch}",
                 data, f"guided decoding at batch {args.batch}, {args.preset}, ms per step\n\n{md}")
    eng.close()


if __name__ == "__main__":
    main()
