"""The engine's options and the GPU worker's, each declared once.

`EngineSettings` is where an engine option lives: its FIRSTTOKEN_* variable, its CLI flag
(`add_arguments`, for `firsttoken run`, `generate` and `worker`), its default, and its place in
`EngineConfig` (`engine_config`). A flag given on the command line wins over the variable, which
wins over the default. `WorkerSettings` adds what only a worker process has (its bounds, its
engine process, its metrics port). The settings every side shares (Kafka, the store, Redis, the
API) are pipeline.settings.Settings.
"""

from __future__ import annotations

import argparse
import types
import typing
from typing import Annotated, Any, Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from pipeline.settings import DEFAULT_MODEL, model_field

if typing.TYPE_CHECKING:
    from workers.engine import EngineConfig

DEFAULT_METRICS_PORT = 9400  # a GPU worker's Prometheus port (FIRSTTOKEN_METRICS_PORT; compose scrapes it)

_MODEL_HELP = (
    f"a real model ({DEFAULT_MODEL}: fetched and converted once), a Hugging Face checkpoint directory, or a "
    "random-weight preset named explicitly (tiny, llama3-8b, ...: garbage text, for tests and benchmarks)"
)


# variables of options that were removed: a deployment still setting one gets an error, not a
# silently different engine (unknown FIRSTTOKEN_* variables are otherwise ignored)
REMOVED_VARIABLES = {
    "FIRSTTOKEN_FP8_WEIGHT_GROUP": "FP8 weight groups were removed (2026-12-02): FP8 is per channel only",
    "FIRSTTOKEN_FP8_ACT_GROUP": "block-wise FP8 was removed (2026-12-02): FP8 is per channel only",
}


class EngineSettings(BaseSettings):
    """Which model the engine runs, where, and how (see EngineConfig for what each option does)."""

    model_config = SettingsConfigDict(env_prefix="FIRSTTOKEN_", extra="ignore", frozen=True)

    def model_post_init(self, context: Any, /) -> None:
        import os

        for name, why in REMOVED_VARIABLES.items():
            if os.environ.get(name) is not None:
                raise ValueError(f"{name} is set, but {why}; unset it")

    model: str = model_field(_MODEL_HELP)
    device: str | None = Field(default=None, description="cuda or cpu (default: cuda when available)")
    dtype: str | None = Field(default=None, description="float32, bfloat16 or float16 (default: the checkpoint's)")
    max_model_len: int | None = Field(default=None, ge=2, description="context length (default: the model's)")
    max_num_seqs: int = Field(
        default=512, ge=1,
        description="most sequences in one step (512 gave ~7 percent more offline throughput than 256 on an H200)",
    )
    kv_cache_dtype: Literal["auto", "fp8"] = Field(
        default="auto",
        description="KV cache: the model's dtype (auto) or fp8 e4m3 (twice the tokens; outputs may differ slightly)",
    )
    quantization: Literal["fp8"] | None = Field(
        default=None, description="fp8: W8A8 e4m3 projections (per-channel weight scales, per-token activations)"
    )
    fp8_lm_head: bool = Field(
        default=False,
        description="with quantization fp8: the lm_head in FP8 too (less to read per decode step, less accurate logits)",
    )
    fp8_attention: bool | None = Field(
        default=None,
        description="with quantization fp8 and an fp8 KV cache: long uncached prompts' attention on FP8 tensor "
                    "cores (cuDNN's sdpa_fp8, the gpu extra); unset: wherever it runs",
    )
    kv_reserve: Annotated[float, Field(ge=0.0, le=1.0)] | Literal["auto"] = Field(
        default="auto",
        description="admit a request only while free KV blocks keep this share of every running request's "
                    "remaining max_tokens (1: none is ever preempted and recomputed; 0: admit while its prompt fits; "
                    "auto: 0.85 x the share of max_tokens that finished requests used)",
    )
    tpot_target_ms: float | None = Field(
        default=None, gt=0,
        description="while requests decode, size each step to keep time per output token under this",
    )

    def engine_config(self) -> EngineConfig:
        """The EngineConfig of these options (the model is LLMEngine's first argument)."""
        from workers.engine import EngineConfig  # (torch: only when an engine is made, not for a CLI flag)

        return EngineConfig(**{name: getattr(self, name) for name in ENGINE_FIELDS})

    @classmethod
    def add_arguments(cls, parser: argparse.ArgumentParser, *, model_help: str | None = None) -> None:
        """A flag per option (`--max-model-len` for max_model_len, ...), its help from the field.
        Flags default to "not given", so that the variable or the default applies (from_args)."""
        for name, field in EngineSettings.model_fields.items():
            flag = "--" + name.replace("_", "-")
            default = field.default
            help_ = field.description or ""
            if name == "model" and model_help:
                help_ = f"{help_}; {model_help}"
            help_ += f" [FIRSTTOKEN_{name.upper()}; default {default}]"
            kind, choices = _argparse_type(field.annotation)
            parser.add_argument(flag, dest=name, type=kind, choices=choices, default=None, help=help_)

    @classmethod
    def cli_values(cls, args: argparse.Namespace) -> dict[str, Any]:
        """The engine options given on the command line."""
        return {n: getattr(args, n) for n in EngineSettings.model_fields if getattr(args, n, None) is not None}

    @classmethod
    def from_args(cls, args: argparse.Namespace, **values: Any) -> typing.Self:
        """These settings from the flags given, then the FIRSTTOKEN_* variables, then the defaults."""
        return cls(**{**cls.cli_values(args), **values})


# the options EngineConfig takes as they are (all but the model)
ENGINE_FIELDS = tuple(n for n in EngineSettings.model_fields if n != "model")


def _argparse_type(annotation: Any) -> tuple[Any, list[str] | None]:
    args = [a for a in typing.get_args(annotation) if a is not type(None)] or [annotation]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        if len(args) > 1:  # e.g. a number or "auto": the settings model parses the string
            return str, None
        annotation = args[0]
    if typing.get_origin(annotation) is Literal:
        return str, [str(v) for v in typing.get_args(annotation)]
    return (annotation if annotation in (int, float) else str), None


class WorkerSettings(EngineSettings):
    """The GPU worker's settings: its engine's, and the worker's own bounds, from FIRSTTOKEN_*
    variables (shared ones live in pipeline.settings.Settings)."""

    max_waiting: int = 512
    drain_timeout_s: float = 30.0
    sink_max_buffer: int = 10_000
    max_deliveries: int | None = 3  # see WorkerConfig; 0: no admission lookup
    # The engine in a child process of its own (workers.engine_core.ProcessCore), away from the
    # GIL of the intake and the Kafka client; False: on a thread of the worker's process.
    engine_process: bool = True
    torch_threads: int | None = None  # torch's intra-op threads in the engine (CPU engines); None: torch's default
    # Prometheus metrics at http://<host>:<port>/metrics, on by default; a port another process
    # holds (two workers on one host) moves the server to the next free one of the 16 after it. 0: off.
    metrics_port: int = DEFAULT_METRICS_PORT
