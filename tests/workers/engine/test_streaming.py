"""Streamed requests report their text as it grows: every delta extends a prefix of the final
text (text that might still become a stop string is held back), and the final text is exactly
what the same request gives unstreamed."""

from __future__ import annotations

import pytest

from schemas.sampling import SamplingParams
from workers.engine import EngineConfig, LLMEngine

PROMPTS = ["Once upon a time", "Kafka partitions carry", "def fibonacci(n):", "The quick brown fox"]


def _run(engine: LLMEngine, stream: bool, sp: SamplingParams):
    for i, p in enumerate(PROMPTS):
        engine.add_request(f"r{i}", prompt=p, sampling=sp, stream=stream)
    deltas: dict[str, list[tuple[str, int]]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    finished = {}
    while engine.has_unfinished():
        out = engine.step()
        for rid, text, n, offset in out.deltas:
            assert offset == sum(len(t) for t, _ in deltas[rid])  # where the text goes
            deltas[rid].append((text, n))
        for f in out.finished:
            finished[f.request_id] = f
    return deltas, finished


@pytest.mark.parametrize("stop", [[], ["e"], ["the", "a b", "\n"]])
def test_deltas_are_a_prefix_of_the_final_text(llama_dir, stop):
    sp = SamplingParams(max_tokens=24, temperature=0.0, stop=stop)
    engine = LLMEngine(str(llama_dir), EngineConfig(device="cpu"))
    plain_deltas, plain = _run(engine, False, sp)
    assert all(d == [] for d in plain_deltas.values())  # only streamed requests report deltas
    deltas, streamed = _run(engine, True, sp)
    for rid, f in streamed.items():
        assert f.text == plain[rid].text and f.output_token_ids == plain[rid].output_token_ids
        sent = "".join(t for t, _ in deltas[rid])
        assert f.text.startswith(sent), (rid, sent, f.text)
        counts = [n for _, n in deltas[rid]]
        assert counts == sorted(counts) and all(0 < n <= len(f.output_token_ids) for n in counts)
        if not stop:  # nothing held back: all but the last token's text came as deltas
            assert len(deltas[rid]) >= 3 and len(sent) >= len(f.text) // 2
    assert sum(len(d) for d in deltas.values()) > len(PROMPTS)
