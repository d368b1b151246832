"""Offline helper: generate for a list of prompts with one engine, for scripts and benchmarks
(`firsttoken generate` runs its JSONL file through it)."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Literal, overload

from schemas.sampling import SamplingParams
from workers.engine.config import EngineConfig
from workers.engine.engine import LLMEngine
from workers.engine.errors import InvalidRequestError
from workers.engine.outputs import FinishedRequest

_calls = itertools.count()


class LLM:
    """`LLM("tiny").generate(["Hello"], SamplingParams(max_tokens=8))` -> results in input order.

    `LLM(engine=an_engine)` drives an engine built elsewhere (the CLI builds its own, to time it)."""

    def __init__(self, model: str = "tiny", config: EngineConfig | None = None, *, engine: LLMEngine | None = None,
                 **config_kwargs: object) -> None:
        if engine is not None:
            self.engine = engine
            return
        if config is None:
            config = EngineConfig(**config_kwargs)  # type: ignore[arg-type]
        self.engine = LLMEngine(model, config)

    @overload
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = ...,
                 *, errors: Literal["raise"] = ...) -> list[FinishedRequest]: ...

    @overload
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]],
                 sampling: SamplingParams | Sequence[SamplingParams] | None = ...,
                 *, errors: Literal["return"]) -> list[FinishedRequest | InvalidRequestError]: ...

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        errors: Literal["raise", "return"] = "raise",
    ) -> list[FinishedRequest] | list[FinishedRequest | InvalidRequestError]:
        """Run every prompt (text or token ids) to its end; results in prompt order.

        A prompt the engine refuses (InvalidRequestError: too long, bad sampling) raises, after
        the prompts already added are aborted (errors="raise"), or takes the error's place in the
        results while the others run (errors="return")."""
        if sampling is None or isinstance(sampling, SamplingParams):
            sampling = [sampling or SamplingParams()] * len(prompts)
        if len(sampling) != len(prompts):
            raise ValueError("one SamplingParams per prompt, or one for all")
        call = next(_calls)
        slots: list[str | InvalidRequestError] = []
        for i, (p, sp) in enumerate(zip(prompts, sampling)):
            request_id = f"llm-{id(self)}-{call}-{i}"
            try:
                if isinstance(p, str):
                    self.engine.add_request(request_id, prompt=p, sampling=sp)
                else:
                    self.engine.add_request(request_id, prompt_token_ids=list(p), sampling=sp)
            except InvalidRequestError as e:
                if errors == "raise":
                    for added in slots:
                        if isinstance(added, str):
                            self.engine.abort(added)
                    raise
                slots.append(e)
                continue
            slots.append(request_id)
        wanted = {s for s in slots if isinstance(s, str)}
        done: dict[str, FinishedRequest] = {}
        while len(done) < len(wanted):
            for f in self.engine.step().finished:
                if f.request_id in wanted:
                    done[f.request_id] = f
        return [done[s] if isinstance(s, str) else s for s in slots]  # type: ignore[return-value]
