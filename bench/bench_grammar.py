"""Grammar engines for guided decoding, measured on the CPU with SmolLM2-135M's tokenizer.

For llguidance, xgrammar and outlines-core, over a set of JSON schemas of varied difficulty (plus
json_object, a regex and a choice): the tokenizer setup time, each spec's compile time (cold, and
from a compiled grammar held in memory), the per-token mask time (fill the bitmask + accept the
token) p50/p99 while walking random allowed tokens to the grammar's end, and one decode step at
batch 64 (every row's mask for that step, batched/parallel where the library has it, then every
row's accept), and which specs each engine refuses. Every finished walk's text is checked: it parses
and validates against its schema (jsonschema).

    .venv/bin/python bench/bench_grammar.py [--steps 300] [--walks 5] [--out bench/results/NAME]

The deciding number is the batch-64 step: masks are computed on the host while the GPU runs the
step's forward (TPOT at b64 on the H200: ~4.4 ms FP8, ~6.8 ms bf16), so they must fit well inside
it, and what stays on the critical path (apply on the device) within 5% of TPOT.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import git_commit, md_table
from workers.engine.downloads import ensure_model
from workers.engine.tokenizer import Tokenizer, _bytes_to_unicode

WS = (", ", ": ")  # the JSON separators every engine is asked for: compact, one space (no free whitespace)

SCHEMAS: dict[str, dict[str, Any]] = {
    "flat": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                              "active": {"type": "boolean"}},
             "required": ["name", "age", "active"], "additionalProperties": False},
    "optional": {"type": "object", "properties": {"id": {"type": "integer"}, "score": {"type": "number"},
                                                  "note": {"type": "string"}, "tag": {"type": "null"}},
                 "required": ["id"], "additionalProperties": False},
    "nested": {"type": "object", "properties": {
        "user": {"type": "object", "properties": {
            "name": {"type": "string"},
            "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city", "zip"], "additionalProperties": False}},
            "required": ["name", "address"], "additionalProperties": False}},
        "required": ["user"], "additionalProperties": False},
    "array": {"type": "object", "properties": {
        "items": {"type": "array", "minItems": 1, "maxItems": 4, "items": {
            "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"], "additionalProperties": False}}},
        "required": ["items"], "additionalProperties": False},
    "enum": {"type": "object", "properties": {
        "status": {"enum": ["open", "closed", "pending"]}, "level": {"enum": [1, 2, 3, None]},
        "kind": {"const": "ticket"}}, "required": ["status", "level", "kind"], "additionalProperties": False},
    "formats": {"type": "object", "properties": {
        "email": {"type": "string", "format": "email"}, "when": {"type": "string", "format": "date-time"},
        "id": {"type": "string", "format": "uuid"}, "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{4}$"},
        "short": {"type": "string", "minLength": 2, "maxLength": 8}},
        "required": ["email", "when", "id", "code", "short"], "additionalProperties": False},
    "anyof": {"type": "object", "properties": {
        "value": {"anyOf": [{"type": "string"}, {"type": "number"}, {"type": "null"}]},
        "shape": {"anyOf": [
            {"type": "object", "properties": {"r": {"type": "number"}}, "required": ["r"], "additionalProperties": False},
            {"type": "object", "properties": {"w": {"type": "number"}, "h": {"type": "number"}},
             "required": ["w", "h"], "additionalProperties": False}]}},
        "required": ["value", "shape"], "additionalProperties": False},
    "bounds": {"type": "object", "properties": {
        "pct": {"type": "integer", "minimum": 0, "maximum": 100}, "temp": {"type": "number", "minimum": -50, "maximum": 60},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3}},
        "required": ["pct", "temp", "tags"], "additionalProperties": False},
    "dict": {"type": "object", "additionalProperties": {"type": "integer"}, "maxProperties": 5},
    "refs": {"$defs": {"point": {"type": "object", "properties": {"x": {"type": "number"}, "y": {"type": "number"}},
                                 "required": ["x", "y"], "additionalProperties": False}},
             "type": "object", "properties": {"a": {"$ref": "#/$defs/point"}, "b": {"$ref": "#/$defs/point"}},
             "required": ["a", "b"], "additionalProperties": False},
    "recursive": {"$defs": {"node": {"type": "object", "properties": {
        "v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}, "maxItems": 2}},
        "required": ["v"], "additionalProperties": False}}, "$ref": "#/$defs/node"},
    "wide": {"type": "object", "properties": {f"f{i}": {"type": ["string", "integer", "boolean"][i % 3]} for i in range(30)},
             "required": [f"f{i}" for i in range(30)], "additionalProperties": False},
    "multipleof": {"type": "object", "properties": {"n": {"type": "integer", "multipleOf": 5}},
                   "required": ["n"], "additionalProperties": False},
    "uniqueitems": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True, "maxItems": 3},
    "not": {"type": "object", "properties": {"x": {"not": {"type": "string"}}}, "required": ["x"]},
    "ifthen": {"type": "object", "properties": {"a": {"type": "integer"}},
               "if": {"properties": {"a": {"const": 1}}}, "then": {"required": ["a"]}},
}
REGEX = r"\(?[0-9]{3}\)?[ -][0-9]{3}-[0-9]{4}( ext [0-9]{1,4})?"
CHOICES = ["positive", "negative", "neutral", "mixed (see notes)"]


def escape_regex(s: str) -> str:
    """A literal in the regex dialect all three engines share (Rust regex, ECMAScript-like)."""
    return "".join("\\" + c if c in "\\.+*?()|[]{}^$" else c for c in s)


def specs() -> list[tuple[str, str, Any]]:
    """(name, kind, spec): kind is json_schema, json_object, regex."""
    out = [(n, "json_schema", s) for n, s in SCHEMAS.items()]
    out.append(("json_object", "json_schema", {"type": "object"}))
    out.append(("regex", "regex", REGEX))
    out.append(("choice", "regex", "(" + "|".join(escape_regex(c) for c in CHOICES) + ")"))
    return out


def check_text(name: str, text: str) -> bool:
    """The finished output is in the language: parses and validates (schemas), matches (regex/choice)."""
    import jsonschema

    if name == "regex":
        return re.fullmatch(REGEX, text) is not None
    if name == "choice":
        return text in CHOICES
    try:
        value = json.loads(text)
    except ValueError:
        return False
    schema = {"type": "object"} if name == "json_object" else SCHEMAS[name]
    try:
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())
    except jsonschema.ValidationError:
        return False
    return True


# --- the engines: one small adapter each ------------------------------------------------------

class Llguidance:
    name = "llguidance"

    def __init__(self, tok: Tokenizer, vocab: int, eos: int, threads: int) -> None:
        import llguidance

        self.ll = llguidance  # (not llguidance.torch: importing it imports torch._dynamo, seconds)
        self.tok = llguidance.LLTokenizer(tok._tok.to_str(), n_vocab=vocab, eos_token=eos)
        self.executor = llguidance.LLExecutor(num_threads=threads)
        self.version = llguidance.__version__

    def compile(self, kind: str, spec: Any) -> Any:
        M = self.ll.LLMatcher
        if kind == "json_schema":
            g = M.grammar_from_json_schema(spec, overrides={"item_separator": WS[0], "key_separator": WS[1],
                                                            "whitespace_flexible": False})
        else:
            g = M.grammar_from_regex(spec)
        m = M(self.tok, g, log_level=0)
        if m.is_error():
            raise ValueError(m.get_error())
        return m  # a fresh matcher is the compiled form: new ones are deep copies

    def matcher(self, compiled: Any) -> Any:
        return compiled.deep_copy()

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, m: Any, token: int) -> bool:
        return m.consume_token(token)

    def batch_fill(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        self.executor.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], bitmask.data_ptr(),
                                              bitmask.shape[1] * 4, bitmask.shape[0])

    def batch_accept(self, ms: list[Any], tokens: list[int]) -> list[bool]:
        return self.executor.consume_token_par(list(zip(ms, tokens)))


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tok: Tokenizer, vocab: int, eos: int, threads: int) -> None:
        from importlib.metadata import version

        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        hf = PreTrainedTokenizerFast(tokenizer_object=tok._tok)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab, stop_token_ids=[eos])
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.batch = xgr.BatchGrammarMatcher(max_threads=threads)
        self.version = version("xgrammar")

    def compile(self, kind: str, spec: Any) -> Any:
        if kind == "json_schema":
            return self.compiler.compile_json_schema(json.dumps(spec), any_whitespace=False, separators=WS,
                                                     strict_mode=False)
        return self.compiler.compile_regex(spec)

    def matcher(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m: Any, token: int) -> bool:
        return m.accept_token(token)

    def batch_fill(self, ms: list[Any], bitmask: torch.Tensor) -> None:
        self.batch.batch_fill_next_token_bitmask(ms, bitmask)

    def batch_accept(self, ms: list[Any], tokens: list[int]) -> list[bool]:
        return self.xgr.BatchGrammarMatcher.batch_accept_token(ms, tokens)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tok: Tokenizer, vocab: int, eos: int, threads: int) -> None:
        from importlib.metadata import version

        import outlines_core as oc

        self.oc = oc
        inv = {c: b for b, c in _bytes_to_unicode().items()}
        special = {t.content for t in tok._tok.get_added_tokens_decoder().values()}
        by_bytes: dict[bytes, list[int]] = {}
        for s, i in tok._tok.get_vocab(with_added_tokens=False).items():
            if s in special:
                continue
            by_bytes.setdefault(bytes(inv[c] for c in s), []).append(i)
        self.vocab, self.eos = oc.Vocabulary(eos, by_bytes), eos
        self.words = (vocab + 31) // 32
        self.version = version("outlines-core")

    def compile(self, kind: str, spec: Any) -> Any:
        regex = (self.oc.json_schema.build_regex_from_schema(json.dumps(spec), r" ?") if kind == "json_schema"
                 else spec)
        return self.oc.Index(regex, self.vocab)

    def matcher(self, compiled: Any) -> Any:
        return self.oc.Guide(compiled)

    def fill(self, m: Any, bitmask: torch.Tensor, row: int) -> None:
        v = bitmask[row]
        m.write_mask_into(v.data_ptr(), v.numel(), 4)

    def accept(self, m: Any, token: int) -> bool:
        if token == self.eos:  # a final state's only way out: advancing by it raises
            return m.is_finished()
        try:
            m.advance(token, return_tokens=False)
        except ValueError:
            return False
        return True

    def batch_fill(self, ms: list[Any], bitmask: torch.Tensor) -> None:  # no batched fill: a loop
        for i, m in enumerate(ms):
            self.fill(m, bitmask, i)

    def batch_accept(self, ms: list[Any], tokens: list[int]) -> list[bool]:
        return [self.accept(m, t) for m, t in zip(ms, tokens)]


ENGINES = {"llguidance": Llguidance, "xgrammar": Xgrammar, "outlines-core": OutlinesCore}


# --- the walks ----------------------------------------------------------------------------------

class Walker:
    """Chooses a random allowed token from a bitmask row; a quarter of the time among the allowed
    tokens that close something (a quote, brace, bracket, comma or the end), so walks finish."""

    def __init__(self, tok: Tokenizer, vocab: int, eos: int) -> None:
        self.vocab, self.eos = vocab, eos
        texts = tok.decode_each(list(range(tok.vocab_size)))
        closing = np.zeros(vocab, dtype=bool)
        for i, t in enumerate(texts):
            closing[i] = any(c in t for c in '"}],')
        closing[eos] = True
        self.closing = closing

    def allowed(self, row: torch.Tensor) -> np.ndarray:
        bits = np.unpackbits(row.numpy().view(np.uint8), bitorder="little")[: self.vocab]
        return bits.astype(bool)

    def choose(self, row: torch.Tensor, rng: np.random.Generator) -> int | None:
        ok = self.allowed(row)
        ids = np.flatnonzero(ok)
        if len(ids) == 0:
            return None
        if rng.random() < 0.25:
            close = np.flatnonzero(ok & self.closing)
            if len(close):
                ids = close
        return int(ids[rng.integers(len(ids))])


def pct(xs: list[float], q: float) -> float | None:
    return float(np.percentile(xs, q)) if xs else None


def walk_one(eng: Any, compiled: Any, walker: Walker, tok: Tokenizer, rng: np.random.Generator,
             max_tokens: int) -> tuple[list[float], list[float], str | None]:
    """One matcher walked to its end: per-token fill and accept times (ms), and the finished text
    (None when it hit max_tokens or a refused token)."""
    m = eng.matcher(compiled)
    bitmask = torch.zeros((1, (walker.vocab + 31) // 32), dtype=torch.int32)
    fills, accepts, out = [], [], []
    for _ in range(max_tokens):
        t0 = time.perf_counter_ns()
        eng.fill(m, bitmask, 0)
        t1 = time.perf_counter_ns()
        t = walker.choose(bitmask[0], rng)
        if t is None:
            return fills, accepts, None
        t2 = time.perf_counter_ns()
        ok = eng.accept(m, t)
        t3 = time.perf_counter_ns()
        fills.append((t1 - t0) / 1e6)
        accepts.append((t3 - t2) / 1e6)
        if not ok:
            return fills, accepts, None
        if t == walker.eos:
            return fills, accepts, tok.decode(out)
        out.append(t)
    return fills, accepts, None


IMPORTS = {"llguidance": ["llguidance"], "xgrammar": ["xgrammar", "transformers"], "outlines-core": ["outlines_core"]}


def bench_engine(cls: Any, tok: Tokenizer, vocab: int, eos: int, args: argparse.Namespace) -> dict[str, Any]:
    import importlib

    t0 = time.perf_counter()
    for mod in IMPORTS[cls.name]:
        importlib.import_module(mod)
    import_ms = (time.perf_counter() - t0) * 1e3
    t0 = time.perf_counter()
    eng = cls(tok, vocab, eos, args.threads)
    setup_ms = (time.perf_counter() - t0) * 1e3
    walker = Walker(tok, vocab, eos)
    rng = np.random.default_rng(0)
    per_spec, compiled = [], {}
    all_tok: list[float] = []
    for name, kind, spec in specs():
        row: dict[str, Any] = {"spec": name}
        t0 = time.perf_counter()
        try:
            c = eng.compile(kind, spec)
        except Exception as exc:  # the engine refuses the spec
            row["refused"] = f"{type(exc).__name__}: {str(exc)[:160]}"
            per_spec.append(row)
            continue
        row["compile_cold_ms"] = (time.perf_counter() - t0) * 1e3
        compiled[name] = c
        t0 = time.perf_counter()
        for _ in range(20):
            eng.matcher(c)
        row["matcher_from_cache_ms"] = (time.perf_counter() - t0) * 1e3 / 20
        fills, accepts, done, valid = [], [], 0, 0
        for _ in range(args.walks):
            f, a, text = walk_one(eng, c, walker, tok, rng, args.max_tokens)
            fills += f
            accepts += a
            if text is not None:
                done += 1
                valid += check_text(name, text)
        tot = [f + a for f, a in zip(fills, accepts)]
        all_tok += tot
        if valid < done:
            row["not_enforced"] = True
        row.update(tokens=len(tot), walks_done=f"{done}/{args.walks}", valid=f"{valid}/{done}",
                   fill_p50_ms=pct(fills, 50), fill_p99_ms=pct(fills, 99),
                   token_p50_ms=pct(tot, 50), token_p99_ms=pct(tot, 99))
        per_spec.append(row)
    batch = bench_batch(eng, compiled, walker, args) if compiled else {}
    return {"engine": eng.name, "version": eng.version, "import_ms": import_ms, "tokenizer_setup_ms": setup_ms,
            "refused": sorted(r["spec"] for r in per_spec if "refused" in r),
            "not_enforced": sorted(r["spec"] for r in per_spec if r.get("not_enforced")),
            "token_p50_ms": pct(all_tok, 50), "token_p99_ms": pct(all_tok, 99),
            "specs": per_spec, "batch64": batch}


def bench_batch(eng: Any, compiled: dict[str, Any], walker: Walker, args: argparse.Namespace) -> dict[str, Any]:
    """64 matchers in lockstep, row i on spec i % n (of those the engine compiled); a finished one
    is replaced by a fresh matcher. Per step: all 64 masks, then all 64 accepts; even steps through
    the engine's batched (parallel) calls, odd steps one row at a time."""
    rng = np.random.default_rng(1)
    names = sorted(compiled)
    B = 64
    ms = [eng.matcher(compiled[names[i % len(names)]]) for i in range(B)]
    lens = [0] * B
    bitmask = torch.zeros((B, (walker.vocab + 31) // 32), dtype=torch.int32)
    fill_ms, step_ms, seq_fill_ms, seq_step_ms = [], [], [], []
    row_max: dict[str, float] = {}  # spec -> its slowest single mask in the one-by-one steps
    for step in range(args.steps + 10):
        parallel = step % 2 == 0  # alternate steps: the batched fill, or one row at a time
        t0 = time.perf_counter_ns()
        if parallel:
            eng.batch_fill(ms, bitmask)
        else:
            for i in range(B):
                r0 = time.perf_counter_ns()
                eng.fill(ms[i], bitmask, i)
                name = names[i % len(names)]
                row_max[name] = max(row_max.get(name, 0.0), (time.perf_counter_ns() - r0) / 1e6)
        t1 = time.perf_counter_ns()
        toks = []
        for i in range(B):
            t = walker.choose(bitmask[i], rng)
            toks.append(walker.eos if t is None else t)
        t2 = time.perf_counter_ns()
        if parallel:
            eng.batch_accept(ms, toks)
        else:
            for m, t in zip(ms, toks):
                eng.accept(m, t)
        t3 = time.perf_counter_ns()
        if step >= 10:  # warm
            (fill_ms if parallel else seq_fill_ms).append((t1 - t0) / 1e6)
            (step_ms if parallel else seq_step_ms).append((t1 - t0 + t3 - t2) / 1e6)
        for i, t in enumerate(toks):
            lens[i] += 1
            if t == walker.eos or lens[i] >= args.max_tokens:
                ms[i] = eng.matcher(compiled[names[i % len(names)]])
                lens[i] = 0
    return {"rows": B, "specs": len(names), "steps": len(step_ms) + len(seq_step_ms),
            "fill_p50_ms": pct(fill_ms, 50), "fill_p99_ms": pct(fill_ms, 99),
            "step_p50_ms": pct(step_ms, 50), "step_p99_ms": pct(step_ms, 99),
            "sequential_fill_p50_ms": pct(seq_fill_ms, 50), "sequential_fill_p99_ms": pct(seq_fill_ms, 99),
            "sequential_step_p50_ms": pct(seq_step_ms, 50), "sequential_step_p99_ms": pct(seq_step_ms, 99),
            "slowest_row_ms": dict(sorted(row_max.items(), key=lambda kv: -kv[1])[:5])}


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "cpu"


def markdown(data: dict[str, Any]) -> str:
    h = data["header"]
    lines = [f"# Grammar engines on the CPU ({h['date']}, commit {h['commit']})", "",
             f"Machine: {h['machine']}. Tokenizer: {h['tokenizer']} (vocab {h['vocab']}). "
             f"{data['args']['walks']} seeded random walks per spec, batch 64 over {data['args']['steps']} steps, "
             f"{data['args']['threads']} threads for the parallel fills. Times in ms.", "",
             "## Summary", ""]
    rows = []
    for e in data["engines"]:
        b = e["batch64"]
        rows.append({"engine": f"{e['engine']} {e['version']}", "import": e["import_ms"],
                     "tokenizer setup": e["tokenizer_setup_ms"],
                     "token p50": e["token_p50_ms"], "token p99": e["token_p99_ms"],
                     "b64 fill p50": b.get("fill_p50_ms"), "b64 fill p99": b.get("fill_p99_ms"),
                     "b64 fill+accept p50": b.get("step_p50_ms"), "b64 fill+accept p99": b.get("step_p99_ms"),
                     "b64 one-by-one fill p50": b.get("sequential_fill_p50_ms"),
                     "b64 one-by-one fill p99": b.get("sequential_fill_p99_ms"),
                     "b64 one-by-one fill+accept p50": b.get("sequential_step_p50_ms"),
                     "b64 one-by-one fill+accept p99": b.get("sequential_step_p99_ms"),
                     "refused": ", ".join(e["refused"]) or "none",
                     "accepted, output invalid": ", ".join(e["not_enforced"]) or "none"})
    lines.append(md_table(rows, list(rows[0])))
    for e in data["engines"]:
        lines += ["", f"## {e['engine']} {e['version']}", ""]
        cols = ["spec", "compile_cold_ms", "matcher_from_cache_ms", "tokens", "walks_done", "valid",
                "fill_p50_ms", "fill_p99_ms", "token_p50_ms", "token_p99_ms", "refused"]
        lines.append(md_table(e["specs"], cols))
        slow = ", ".join(f"{k} {v:.2f}" for k, v in e["batch64"].get("slowest_row_ms", {}).items())
        lines += ["", f"Batch 64, the slowest single masks (ms) by spec: {slow}"]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--engines", default="llguidance,xgrammar,outlines-core")
    ap.add_argument("--walks", type=int, default=5, help="random walks per spec")
    ap.add_argument("--max-tokens", type=int, default=512, help="a walk's cap")
    ap.add_argument("--steps", type=int, default=300, help="batch-64 steps timed")
    ap.add_argument("--threads", type=int, default=2, help="threads of the parallel fills")
    ap.add_argument("--tokenizer", choices=["smollm2", "tiny"], default="smollm2")
    ap.add_argument("--out", default=None, help="write OUT.json and OUT.md")
    args = ap.parse_args()
    if args.tokenizer == "tiny":  # the tiny preset's byte-level tokenizer: a smoke run (tests/test_bench_smoke.py)
        tok, vocab, eos, tok_name = Tokenizer.byte_level(256, 257), 512, 257, "tiny (byte-level)"
    else:
        path = ensure_model("smollm2-135m")
        tok = Tokenizer.from_dir(path)
        vocab = json.loads((path / "config.json").read_text())["vocab_size"]
        eos = tok._tok.token_to_id(tok.special["eos_token"])
        tok_name = "SmolLM2-135M-Instruct"
    data: dict[str, Any] = {
        "header": {"date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                   "commit": git_commit(), "machine": f"{cpu_name()}, {torch.get_num_threads()} threads",
                   "tokenizer": tok_name, "vocab": vocab, "eos": eos},
        "args": vars(args), "engines": []}
    for name in args.engines.split(","):
        print(f"# {name}", file=sys.stderr, flush=True)
        data["engines"].append(bench_engine(ENGINES[name], tok, vocab, eos, args))
    text = json.dumps(data, indent=2)
    md = markdown(data)
    print(text)
    print(md)
    if args.out:
        Path(args.out + ".json").write_text(text + "\n")
        Path(args.out + ".md").write_text(md + "\n")


if __name__ == "__main__":
    main()
