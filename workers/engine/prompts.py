"""A job's prompt as token ids, and the engine's admission checks that need no GPU.

Plain prompts are encoded with the tokenizer's special tokens (a BOS where the checkpoint adds
one); chat turns are rendered with the checkpoint's template, which writes its own special
tokens, and encoded without adding them again: the ids transformers' `apply_chat_template`
gives. A model without a template (the random presets) gets a `role: content` transcript.

The admission checks (`sampling_problem`, `length_problem`) are the engine's and the
submission's alike, with the same error codes: `SubmitCheck` runs them at submission, where the
model is known, so a prompt that cannot fit is that line's `prompt_too_long` at once, not minutes
later on a worker, and LLMEngine.add_request runs them again on the worker.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from schemas.grammar import job_grammar_problem
from schemas.job import ErrorCode, JobRequest
from schemas.sampling import SamplingParams
from schemas.tools import template_tools
from workers.engine.chat_template import ChatTemplateError
from workers.engine.config import ModelConfig
from workers.engine.downloads import resolve_model, unknown_model_message
from workers.engine.errors import CheckpointError, InvalidRequestError
from workers.engine.presets import PRESETS
from workers.engine.tokenizer import Tokenizer


def _checkpoint_dir(model: str) -> Path:
    path = Path(resolve_model(model))
    if not path.is_dir():
        raise CheckpointError(unknown_model_message(model))
    return path


def load_tokenizer(model: str) -> Tokenizer:
    """The tokenizer of a preset (byte-level) or of a checkpoint directory. Raises CheckpointError."""
    if model in PRESETS:
        bos, eos = (256, 257) if model == "tiny" else (None, None)
        return Tokenizer.byte_level(bos, eos)
    path = _checkpoint_dir(model)
    try:
        return Tokenizer.from_dir(path)
    except CheckpointError:
        raise
    except Exception as exc:  # a broken tokenizer.json (the tokenizers library raises a bare Exception)
        raise CheckpointError(f"{path}: cannot read its tokenizer ({type(exc).__name__}: {exc})") from None


def _model_config(model: str) -> ModelConfig:
    if model in PRESETS:
        return PRESETS[model]
    path = _checkpoint_dir(model)
    try:
        return ModelConfig.from_dir(path)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"{path}: cannot read config.json ({type(exc).__name__}: {exc})") from None


def model_context(model: str, max_model_len: int | None = None) -> int:
    """The context length the engine serves `model` with (its max_position_embeddings unless
    capped). Raises CheckpointError."""
    return max_model_len or _model_config(model).max_position_embeddings


# a chat turn: (role, content), or the message dict a template is given (ChatMessage.turn())
Turn = tuple[str, str] | Mapping[str, Any]


def _call_for_template(call: Mapping[str, Any]) -> dict[str, Any]:
    """An assistant turn's tool call with its arguments as an object, as chat templates (and
    transformers' documentation) expect them; arguments that are no JSON object stay text."""
    fn = dict(call.get("function") or {})
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            parsed = None
        if isinstance(parsed, dict):
            fn["arguments"] = parsed
    return {**call, "function": fn}


def _calls_as_text(calls: list[dict[str, Any]]) -> str:
    """Tool calls written the way Hermes / Qwen templates write them (for a template that does
    not render tool_calls: the model still sees what it called)."""
    return "\n".join("<tool_call>\n" + json.dumps({"name": c["function"].get("name"), "arguments":
                      c["function"].get("arguments")}, ensure_ascii=False) + "\n</tool_call>" for c in calls)


def template_turns(messages: Sequence[Turn], template: str | None) -> list[dict[str, Any]]:
    """The message dicts a chat template is given. Tool calls' arguments become objects; a
    template that never mentions `tool_calls` gets an assistant turn's calls in its content instead
    (Hermes' `<tool_call>` form), and no turn's content is then null."""
    renders_calls = template is not None and "tool_calls" in template
    out = []
    for t in messages:
        turn = {"role": t[0], "content": t[1]} if isinstance(t, tuple) else dict(t)
        calls = [_call_for_template(c) for c in turn.get("tool_calls") or ()]
        if calls and renders_calls:
            turn["tool_calls"] = calls
        elif calls:
            del turn["tool_calls"]
            turn["content"] = "\n".join(x for x in (turn.get("content"), _calls_as_text(calls)) if x)
        out.append(turn)
    return out


def prompt_token_ids(
    tokenizer: Tokenizer, prompt: str | None, messages: Sequence[Turn] | None,
    tools: list[dict[str, Any]] | None = None,
) -> list[int]:
    """The token ids of a job's prompt: text, or chat turns (with the tools the model may call,
    passed to the template as transformers does).

    Raises InvalidRequestError (invalid_request) when the chat template refuses the turns.
    """
    if prompt is not None:
        return tokenizer.encode(prompt)
    turns = template_turns(messages or (), tokenizer.chat_template)
    if not tokenizer.chat_template:
        text = "" if not tools else "tools: " + json.dumps(tools, ensure_ascii=False) + "\n"
        text += "".join(f"{t['role']}: {t.get('content') or ''}\n" for t in turns) + "assistant:"
        return tokenizer.encode(text)
    try:
        text = tokenizer.apply_chat_template(turns, tools=tools)
    except ChatTemplateError as exc:
        raise InvalidRequestError(ErrorCode.INVALID_REQUEST, f"chat template: {exc}") from None
    return tokenizer.encode(text, add_special_tokens=False)


Problem = tuple[ErrorCode, str]


def sampling_problem(sp: SamplingParams, *, vocab_size: int | None) -> Problem | None:
    """What the model makes of a request's sampling, before its prompt is tokenized (top_k or a
    logit_bias token past the vocabulary): None when it can run, else (ErrorCode, message)."""
    if sp.top_k is not None and vocab_size is not None and sp.top_k > vocab_size:
        return ErrorCode.INVALID_SAMPLING, f"top_k must be at most the vocabulary ({vocab_size}), or -1 for no cut"
    if sp.logit_bias:  # (a negative id is refused by the schema, but not in a model_construct()ed one)
        lo, hi = min(sp.logit_bias), max(sp.logit_bias)
        if lo < 0 or (vocab_size is not None and hi >= vocab_size):
            return (ErrorCode.INVALID_SAMPLING,
                    f"logit_bias names token {lo if lo < 0 else hi}, outside the vocabulary"
                    f"{'' if vocab_size is None else f' ({vocab_size} tokens)'}")
    return None


def token_ids_problem(ids: Sequence[int], vocab_size: int | None) -> Problem | None:
    """Whether a prompt given as token ids names only tokens of the vocabulary: None when it
    does, else (ErrorCode, message) naming the first id outside it."""
    bad = next((t for t in ids if t < 0 or (vocab_size is not None and t >= vocab_size)), None)
    if bad is None:
        return None
    where = "" if vocab_size is None else f" ({vocab_size} tokens: ids 0 to {vocab_size - 1})"
    return ErrorCode.INVALID_REQUEST, f"token id {bad} is outside the vocabulary{where}"


def length_problem(n: int, sp: SamplingParams, *, max_model_len: int, kv_capacity: int | None = None) -> Problem | None:
    """Whether a prompt of `n` tokens and its max_tokens fit the context (and the KV cache, when
    its capacity is given): None when they do, else (ErrorCode, message). In this order: no
    tokens, the prompt alone past the context, max_tokens alone, both together."""
    if n == 0:
        return ErrorCode.INVALID_REQUEST, "the prompt has no tokens"
    if n >= max_model_len:
        return ErrorCode.PROMPT_TOO_LONG, f"prompt has {n} tokens; the model's context is {max_model_len}"
    if sp.max_tokens >= max_model_len:  # (a request that cannot fit the context, as the others below)
        return (ErrorCode.PROMPT_TOO_LONG,
                f"max_tokens ({sp.max_tokens}) must be below the model's context ({max_model_len} tokens, prompt included)")
    if n + sp.max_tokens > max_model_len:
        return (ErrorCode.PROMPT_TOO_LONG,
                f"prompt ({n} tokens) + max_tokens ({sp.max_tokens}) exceeds the context ({max_model_len})")
    if kv_capacity is not None and n + sp.max_tokens > kv_capacity:
        return ErrorCode.PROMPT_TOO_LONG, f"prompt + max_tokens ({n + sp.max_tokens}) exceeds the KV cache ({kv_capacity} tokens)"
    return None


class SubmitCheck:
    """The context checks of the engine's admission, for a job about to be submitted.

    Call it with a JobRequest: None when it fits, else (ErrorCode, message).
    """

    def __init__(self, tokenizer: Tokenizer, max_model_len: int, vocab_size: int | None = None) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.vocab_size = vocab_size

    @classmethod
    def for_model(cls, model: str, max_model_len: int | None = None) -> SubmitCheck:
        """The check for a preset or checkpoint directory (reads its config and tokenizer, no weights)."""
        mc = _model_config(model)
        return cls(load_tokenizer(model), max_model_len or mc.max_position_embeddings, mc.vocab_size)

    def __call__(self, job: JobRequest) -> Problem | None:
        # the engine's order: sampling, then the prompt's tokens and length, then the grammar
        problem = sampling_problem(job.sampling, vocab_size=self.vocab_size)
        if problem is not None:
            return problem
        return self._prompt_problem(job) or job_grammar_problem(job.sampling)

    def _prompt_problem(self, job: JobRequest) -> Problem | None:
        if job.prompts is not None:
            for j, p in enumerate(job.prompts):
                if isinstance(p, str):
                    n = len(prompt_token_ids(self.tokenizer, p, None))
                else:
                    problem = token_ids_problem(p, self.vocab_size)
                    n = len(p)
                problem = problem or length_problem(n, job.sampling, max_model_len=self.max_model_len)
                if problem is not None:
                    return problem[0], f"prompt {j}: {problem[1]}" if len(job.prompts) > 1 else problem[1]
            return None
        turns = None if job.messages is None else [m.turn() for m in job.messages]
        try:
            n = len(prompt_token_ids(self.tokenizer, job.prompt, turns, template_tools(job.tools)))
        except InvalidRequestError as exc:
            return exc.code, exc.message
        return length_problem(n, job.sampling, max_model_len=self.max_model_len)
