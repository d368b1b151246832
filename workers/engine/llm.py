"""Offline helper: generate for a list of prompts with one engine, for scripts and benchmarks."""

from __future__ import annotations

from collections.abc import Sequence

from schemas.sampling import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.outputs import FinishedRequest


class LLM:
    """`LLM("tiny").generate(["Hello"], SamplingParams(max_tokens=8))` -> results in input order."""

    def __init__(self, model: str = "tiny", config: EngineConfig | None = None, **config_kwargs: object) -> None:
        if config is None:
            config = EngineConfig(**config_kwargs)  # type: ignore[arg-type]
        self.engine = LLMEngine(model, config)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[FinishedRequest]:
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        ids = []
        for i, (p, sp) in enumerate(zip(prompts, sampling)):
            rid = f"llm-{id(self)}-{i}"
            if isinstance(p, str):
                self.engine.add_request(rid, prompt=p, sampling=sp)
            else:
                self.engine.add_request(rid, prompt_token_ids=list(p), sampling=sp)
            ids.append(rid)
        done: dict[str, FinishedRequest] = {}
        while len(done) < len(ids):
            for f in self.engine.step().finished:
                done[f.request_id] = f
        return [done[r] for r in ids]
