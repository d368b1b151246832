"""Chat templates: a checkpoint's Jinja template rendered in a sandbox, as transformers does.

A chat template comes with the checkpoint, so it is untrusted code: it renders in Jinja's
`ImmutableSandboxedEnvironment` (no attribute access to Python internals, no mutation of the
values it is given), with the helpers templates on the Hub rely on and transformers provides:
`raise_exception`, a `tojson` that does not escape non-ASCII or HTML characters, `strftime_now`,
and the `break`/`continue` loop controls. Compiled templates are cached by their text.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# jinja2 before 3.1.6 has known sandbox escapes (CVE-2025-27516 and earlier)
_MIN_JINJA = (3, 1, 6)


class ChatTemplateError(ValueError):
    """The template refused these messages (raise_exception), failed, or tried to break out."""


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(
    x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Jinja's own tojson escapes <, >, & and ' for HTML and non-ASCII characters: not what a prompt wants
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


@lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    """The template compiled in the sandbox. Raises ChatTemplateError if it does not parse."""
    if _version(jinja2.__version__) < _MIN_JINJA:
        raise ChatTemplateError(f"chat templates need jinja2>=3.1.6 (sandbox fixes); found {jinja2.__version__}")
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    try:
        return env.from_string(source)
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(f"the chat template does not parse: {exc}") from None


def render_chat(
    source: str,
    messages: list[dict[str, Any]],
    *,
    add_generation_prompt: bool = True,
    special_tokens: dict[str, str] | None = None,
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """The prompt text of `messages` under the template `source` (special token strings such as
    bos_token and eos_token passed to it; `tools`, the functions the model may call, as
    transformers passes them: OpenAI's tool dicts, or None). Raises ChatTemplateError."""
    template = compile_template(source)
    try:
        return template.render(
            messages=messages, tools=tools, add_generation_prompt=add_generation_prompt, **(special_tokens or {})
        )
    except jinja2.exceptions.SecurityError as exc:
        raise ChatTemplateError(f"the chat template tried an unsafe operation: {exc}") from None
    except jinja2.exceptions.TemplateError as exc:
        raise ChatTemplateError(str(exc)) from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, RecursionError) as exc:
        raise ChatTemplateError(f"the chat template failed: {type(exc).__name__}: {exc}") from None
