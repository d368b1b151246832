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

from collections.abc import Sequence
from pathlib import Path

from schemas.job import ErrorCode, JobRequest
from schemas.sampling import SamplingParams
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


def prompt_token_ids(
    tokenizer: Tokenizer, prompt: str | None, messages: Sequence[tuple[str, str]] | None
) -> list[int]:
    """The token ids of a job's prompt (text, or (role, content) chat turns).

    Raises InvalidRequestError (invalid_request) when the chat template refuses the turns.
    """
    if prompt is not None:
        return tokenizer.encode(prompt)
    turns = [{"role": role, "content": content} for role, content in messages or ()]
    if not tokenizer.chat_template:
        text = "".join(f"{t['role']}: {t['content']}\n" for t in turns) + "assistant:"
        return tokenizer.encode(text)
    try:
        text = tokenizer.apply_chat_template(turns)
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
        problem = sampling_problem(job.sampling, vocab_size=self.vocab_size)
        if problem is not None:
            return problem
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
        turns = None if job.messages is None else [(m.role, m.content) for m in job.messages]
        try:
            n = len(prompt_token_ids(self.tokenizer, job.prompt, turns))
        except InvalidRequestError as exc:
            return exc.code, exc.message
        return length_problem(n, job.sampling, max_model_len=self.max_model_len)
