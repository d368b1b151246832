"""OpenAI (chat) completions request bodies to JobInput fields: what is taken, renamed, ignored,
or accepted only at its default value; the logprobs fields by endpoint. Raises LineError."""

from __future__ import annotations

from typing import Any

from schemas.job import ErrorCode, LineError, prompt_item_problem
from schemas.limits import MAX_LOGPROBS
from schemas.openai.formats import LineFormat
from schemas.openai.guided import GUIDED_FIELDS, openai_guided

# OpenAI body fields taken as they are, renamed, or accepted only at their default (no-op) value.
_OPENAI_SAMPLING = {
    "max_tokens": "max_tokens",
    "max_completion_tokens": "max_tokens",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "seed": "seed",
    "stop": "stop",
    "stop_token_ids": "stop_token_ids",
    "ignore_eos": "ignore_eos",
    "prompt_logprobs": "prompt_logprobs",  # vLLM's extension: score the prompt's tokens
    "presence_penalty": "presence_penalty",
    "frequency_penalty": "frequency_penalty",
    "logit_bias": "logit_bias",
    "repetition_penalty": "repetition_penalty",  # vLLM's extension
    "min_tokens": "min_tokens",  # vLLM's extension
    "n": "n",
}
_OPENAI_IGNORED = frozenset({"model", "user", "store", "metadata", "service_tier", "stream_options"})
_OPENAI_DEFAULT_ONLY: dict[str, tuple[Any, ...]] = {
    "stream": (False, None),
    "echo": (False, None),
    "suffix": (None, ""),
}
# chat only: taken as they are (schemas.tools validates them)
_OPENAI_TOOLS = frozenset({"tools", "tool_choice", "parallel_tool_calls"})


def openai_body_request(body: dict[str, Any], fmt: LineFormat, custom_id: str | None = None) -> dict[str, Any]:
    """The JobInput fields of an OpenAI (chat) completions request body. Raises LineError."""
    request: dict[str, Any] = {} if custom_id is None else {"id": custom_id}
    sampling: dict[str, Any] = {}
    metadata: dict[str, Any] = {}
    guided: dict[str, Any] = {}  # response_format and vLLM's guided_* (schemas.openai.guided)
    for key, value in body.items():
        if key == "messages" and fmt is LineFormat.OPENAI_CHAT:
            request["messages"] = value
        elif key == "prompt" and fmt is LineFormat.OPENAI_COMPLETIONS:
            request.update(openai_prompt(value))
        elif key in _OPENAI_TOOLS and fmt is LineFormat.OPENAI_CHAT:
            if value is not None:
                request[key] = value
        elif key in ("echo", "best_of") and fmt is LineFormat.OPENAI_COMPLETIONS:
            if value is not None:
                sampling[key] = value
        elif key in _OPENAI_SAMPLING:
            if value is not None:
                name = _OPENAI_SAMPLING[key]
                if name in sampling:
                    raise LineError(
                        ErrorCode.INVALID_REQUEST,
                        f"body.{key}: given twice (max_tokens/max_completion_tokens)",
                    )
                sampling[name] = value
        elif key in GUIDED_FIELDS:
            guided[key] = value
        elif key in ("logprobs", "top_logprobs"):
            pass  # below: their meaning depends on the endpoint
        elif key in _OPENAI_IGNORED:
            if key == "model" and isinstance(value, str):
                metadata["model"] = value[:200]
            elif key == "metadata" and isinstance(value, dict):
                metadata.update(value)
        elif key in _OPENAI_DEFAULT_ONLY:
            # by type too: `n: true` is not `n: 1`, nor `echo: 0` `echo: false`
            if not any(value == d and type(value) is type(d) for d in _OPENAI_DEFAULT_ONLY[key]):
                raise LineError(
                    ErrorCode.INVALID_REQUEST, f"body.{key}: not supported (only its default value)"
                )
        else:
            raise LineError(ErrorCode.INVALID_REQUEST, f"body.{str(key)[:60]}: unknown or unsupported field")
    if fmt is LineFormat.OPENAI_CHAT and "messages" not in request:
        raise LineError(ErrorCode.INVALID_REQUEST, "body.messages: required for /v1/chat/completions")
    if fmt is LineFormat.OPENAI_COMPLETIONS and "prompt" not in request and "prompts" not in request:
        raise LineError(ErrorCode.INVALID_REQUEST, "body.prompt: required for /v1/completions")
    spec = openai_guided(guided)
    if spec is not None:
        sampling["guided"] = spec
    n = openai_logprobs_asked(body, fmt)
    if n is not None:
        sampling["logprobs"] = n
    request["sampling"] = sampling
    if metadata:
        request["metadata"] = metadata
    return request


def _is_id(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def openai_prompt(value: object) -> dict[str, Any]:
    """The JobInput field of a completions `prompt`, in OpenAI's four shapes: a string, a list of
    strings, a list of token ids (one prompt), a list of token-id lists. A string, or a list of
    one string, is `prompt`; the others `prompts` (each prompt its own choices). An empty prompt
    (a string, a list, or a token list) is refused here. Raises LineError."""
    if isinstance(value, str):
        if not value:
            raise LineError(ErrorCode.INVALID_REQUEST, "body.prompt: empty")
        return {"prompt": value}
    if not isinstance(value, list):
        raise LineError(ErrorCode.INVALID_REQUEST,
                        "body.prompt: a string, a list of strings, a list of token ids or a list of token-id lists")
    if not value:
        raise LineError(ErrorCode.INVALID_REQUEST, "body.prompt: an empty list (no prompt)")
    if all(_is_id(x) for x in value):
        value = [value]  # one prompt of token ids
    elif not (all(isinstance(x, str) for x in value) or all(isinstance(x, list) for x in value)):
        raise LineError(ErrorCode.INVALID_REQUEST,
                        "body.prompt: strings, token ids and token-id lists cannot be mixed in one list")
    for i, x in enumerate(value):
        problem = prompt_item_problem(x)
        if problem is not None:
            raise LineError(ErrorCode.INVALID_REQUEST, f"body.prompt.{i}: {problem}")
    return {"prompt": value[0]} if len(value) == 1 and isinstance(value[0], str) else {"prompts": value}


def openai_logprobs_asked(body: dict[str, Any], fmt: LineFormat) -> int | None:
    """The alternatives per token a body asks for (None: no logprobs). Completions: `logprobs`, an
    int; chat: `logprobs: true` and `top_logprobs`, an int (0 without it). Raises LineError."""
    lp, top = body.get("logprobs"), body.get("top_logprobs")

    def count(key: str, value: object) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LOGPROBS:
            raise LineError(ErrorCode.INVALID_SAMPLING, f"body.{key}: an integer from 0 to {MAX_LOGPROBS}")
        return value

    if fmt is LineFormat.OPENAI_CHAT:
        if lp is not None and not isinstance(lp, bool):
            raise LineError(ErrorCode.INVALID_REQUEST, "body.logprobs: true or false (the count is top_logprobs)")
        if top is not None and not lp:
            raise LineError(ErrorCode.INVALID_REQUEST, "body.top_logprobs: needs logprobs: true")
        return (0 if top is None else count("top_logprobs", top)) if lp else None
    if top is not None:
        raise LineError(ErrorCode.INVALID_REQUEST, "body.top_logprobs: chat completions only (here: logprobs=N)")
    return None if lp is None or lp is False else count("logprobs", lp)
