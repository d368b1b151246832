"""Sampling parameters: how one job's tokens are chosen and when generation stops."""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from schemas.limits import (
    MAX_CHOICES,
    MAX_GUIDE_CHARS,
    MAX_GUIDE_CHOICES,
    MAX_LOGIT_BIAS,
    MAX_LOGPROBS,
    MAX_STOP_CHARS,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOKENS,
    MAX_TOP_K,
)


class GuidedDecoding(BaseModel):
    """Output constrained to a language: any JSON object (OpenAI's `response_format` json_object), a
    JSON schema (json_schema), a regular expression or one of a list of strings (vLLM's
    guided_regex / guided_choice). The engine masks every token that would leave the language, so
    the output parses (and validates) whenever it ends by the grammar's own end (not by max_tokens)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["json_object", "json_schema", "regex", "choice"]
    json_schema: dict[str, Any] | None = Field(default=None, description="kind json_schema: the schema")
    regex: str | None = Field(default=None, description="kind regex: the whole output matches it")
    choices: list[str] | None = Field(default=None, max_length=MAX_GUIDE_CHOICES,
                                      description="kind choice: the output is one of them")

    @model_validator(mode="after")
    def _one_spec(self) -> GuidedDecoding:
        given = {k for k in ("json_schema", "regex", "choices") if getattr(self, k) is not None}
        want = {"json_object": set(), "json_schema": {"json_schema"}, "regex": {"regex"}, "choice": {"choices"}}[self.kind]
        if given != want:
            raise ValueError(f"guided decoding of kind {self.kind} takes {sorted(want) or 'no spec'}, got {sorted(given)}")
        if self.choices is not None and (not self.choices or any(c == "" for c in self.choices)):
            raise ValueError("guided choices must be non-empty strings")
        if len(self.key) > MAX_GUIDE_CHARS:
            raise ValueError(f"a guided-decoding spec may hold at most {MAX_GUIDE_CHARS} characters")
        return self

    @property
    def key(self) -> str:
        """The spec as canonical JSON: equal specs, equal keys (a compiled grammar's cache key)."""
        return json.dumps({"kind": self.kind, "json_schema": self.json_schema, "regex": self.regex,
                           "choices": self.choices}, sort_keys=True, separators=(",", ":"))


class SamplingParams(BaseModel):
    """How to sample one request's output tokens and when to stop.

    `temperature == 0` means greedy. `top_k` of `None` (or 0) means no top-k cut;
    `top_p == 1` means no nucleus cut. A `seed` makes sampling reproducible per request,
    independent of what else is in the batch. Stop strings are not included in the output.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    # Strict types, as OpenAI's API: no string, bool or float becomes an int, no string or bool a
    # float (an int is a float), and only true/false are booleans. Every number has a bound.
    max_tokens: int = Field(
        default=256, ge=0, le=MAX_TOKENS, strict=True,
        description="most output tokens to generate; 0 only with echo (the prompt alone, scored with logprobs)",
    )
    temperature: float = Field(default=1.0, ge=0.0, le=100.0, strict=True, description="0 means greedy")
    top_k: int | None = Field(
        default=None, ge=-1, le=MAX_TOP_K, strict=True,
        description="keep the k most likely tokens; None, 0 or -1: all (at most the model's vocabulary)",
    )
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, strict=True, description="nucleus mass kept, in (0, 1]")
    seed: int | None = Field(default=None, ge=0, lt=2**63, strict=True, description="per-request RNG seed")
    stop: list[str] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS, description="strings that end generation (not in output)"
    )
    stop_token_ids: list[Annotated[int, Field(ge=0, lt=2**31, strict=True)]] = Field(
        default_factory=list, max_length=MAX_STOP_TOKEN_IDS, description="token ids that end generation"
    )
    ignore_eos: bool = Field(default=False, strict=True, description="keep going past the model's end-of-sequence ids")
    logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, strict=True,
        description="report each output token's log-probability under the model (its raw distribution, before "
        "temperature or top-k/p) and this many most likely tokens beside it; None: no log-probabilities",
    )
    prompt_logprobs: int | None = Field(
        default=None, ge=0, le=MAX_LOGPROBS, strict=True,
        description="the same for each prompt token after the first (given the tokens before it): scoring a "
        "text; the prompt is then computed whole (no prefix-cache reuse)",
    )

    # logits processing, in transformers' order: logit_bias, repetition_penalty, then the OpenAI
    # frequency and presence penalties, then min_tokens (workers/engine/penalties.py). Log-
    # probabilities stay those of the raw distribution
    presence_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, strict=True,
        description="subtracted from the logit of every token the output already holds (OpenAI's)",
    )
    frequency_penalty: float = Field(
        default=0.0, ge=-2.0, le=2.0, strict=True,
        description="subtracted from a token's logit once per time the output already holds it (OpenAI's)",
    )
    repetition_penalty: float = Field(
        default=1.0, gt=0.0, le=100.0, strict=True,
        description="tokens of the prompt or the output: positive logits divided by it, negative ones multiplied "
        "(transformers' and vLLM's); 1: none",
    )
    logit_bias: dict[int, float] = Field(
        default_factory=dict, max_length=MAX_LOGIT_BIAS,
        description="token id -> added to its logit, -100 to 100 (OpenAI's; -100 bans a token)",
    )
    min_tokens: int = Field(
        default=0, ge=0, le=MAX_TOKENS, strict=True,
        description="output tokens before end-of-sequence, stop token ids or stop strings may end it",
    )

    # choices: one job, n of them per prompt (each its own sequence over the prompt's shared KV
    # blocks); best_of: that many sampled per prompt, the n likeliest (cumulative log-probability) kept
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, strict=True, description="choices per prompt")
    best_of: int | None = Field(
        default=None, ge=1, le=MAX_CHOICES, strict=True,
        description="text completions: sample this many per prompt and return the n with the highest "
        "cumulative log-probability (at least n); None: n",
    )

    guided: GuidedDecoding | None = Field(
        default=None, description="constrain the output to JSON, a JSON schema, a regex or a choice (None: free text)"
    )

    echo: bool = Field(
        default=False, strict=True,
        description="text completions: the output starts with the prompt (and, with logprobs, so do the "
        "log-probabilities: the prompt's are computed too)",
    )

    @model_validator(mode="before")
    @classmethod
    def _echo_scores_the_prompt(cls, data: object) -> object:
        """echo with logprobs: the prompt's log-probabilities are computed as well (prompt_logprobs)."""
        if (isinstance(data, dict) and data.get("echo") is True and data.get("logprobs") is not None
                and data.get("prompt_logprobs") is None):
            return {**data, "prompt_logprobs": data["logprobs"]}
        return data

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias_keys(cls, v: object) -> object:
        """OpenAI sends the token ids as JSON object keys: decimal strings."""
        if not isinstance(v, dict):
            return v
        out: dict[object, object] = {}
        for k, x in v.items():
            key = k
            if isinstance(k, str):
                if not k.isascii() or not k.isdigit() or len(k) > 10:
                    raise ValueError(f"logit_bias keys are token ids; got {k[:20]!r}")
                key = int(k)
            elif isinstance(k, bool) or not isinstance(k, int):
                raise ValueError("logit_bias keys are token ids")
            if isinstance(x, bool) or not isinstance(x, int | float):
                raise ValueError("logit_bias values are numbers from -100 to 100")
            out[key] = float(x)
        return out

    @field_validator("logit_bias")
    @classmethod
    def _bias_range(cls, v: dict[int, float]) -> dict[int, float]:
        for k, x in v.items():
            if not 0 <= k < 2**31:
                raise ValueError(f"logit_bias token id {k} out of range")
            if not -100.0 <= x <= 100.0:
                raise ValueError(f"logit_bias of token {k} must be from -100 to 100, not {x}")
        return v

    @model_validator(mode="after")
    def _min_within_max(self) -> SamplingParams:
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})")
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens must be at least 1 (0 only with echo: the prompt alone)")
        if self.best_of is not None and self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) must be at least n ({self.n})")
        return self

    @property
    def samples_per_prompt(self) -> int:
        """Sequences sampled per prompt: best_of, or n."""
        return self.n if self.best_of is None else self.best_of

    @property
    def adjusts_logits(self) -> bool:
        """Whether sampling changes the logits before choosing (penalties, biases, min_tokens)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias or self.min_tokens)

    @property
    def counts_tokens(self) -> bool:
        """Whether the logits depend on the tokens so far (the penalties)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @field_validator("top_k")
    @classmethod
    def _no_cut_as_none(cls, v: int | None) -> int | None:
        return None if v in (0, -1) else v

    @field_validator("stop", mode="before")
    @classmethod
    def _stop_as_list(cls, v: object) -> object:
        if isinstance(v, str):
            return [v]
        return v

    @field_validator("stop")
    @classmethod
    def _no_empty_stop(cls, v: list[str]) -> list[str]:
        if any(s == "" for s in v):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in v):
            raise ValueError(f"a stop string may hold at most {MAX_STOP_CHARS} characters")
        return v

    @property
    def greedy(self) -> bool:
        """True when the output is the argmax at every step."""
        return self.temperature == 0.0
