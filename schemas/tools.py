"""Tools (function calling): the functions a chat job may call, how it may call them (OpenAI's
`tool_choice`), the calls an assistant turn carried, and what a response needs to know to read
tool calls out of the model's text (ToolUse).

`tool_choice` "required" or a named function constrains the output through guided decoding
(`tools_guide`): a named function's output is a JSON object valid under its `parameters`; a
required one's is a JSON array of one or more `{"name": <a function>, "parameters": <its
arguments>}` objects. "auto" leaves the output free (calls the model writes are parsed:
schemas.openai.tool_calls); "none" parses nothing. Either way the tools reach the chat template.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import lru_cache
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, field_validator
from pydantic_core import PydanticCustomError

from schemas.limits import MAX_GUIDE_CHARS, MAX_SCHEMA_DEPTH, MAX_TOOL_DESCRIPTION_CHARS
from schemas.sampling import GuidedDecoding

# OpenAI's rule for function names
FunctionName = Annotated[str, StringConstraints(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]

# the arguments of a function with no `parameters` (OpenAI: an empty parameter list)
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


def _nesting(value: object) -> int:
    """How deep `value` nests lists and objects (a scalar is 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        deepest = max(deepest, d)
        if d > MAX_SCHEMA_DEPTH:
            break
        if isinstance(v, dict):
            stack.extend((c, d + 1) for c in v.values())
        elif isinstance(v, list):
            stack.extend((c, d + 1) for c in v)
    return deepest


_KEYWORDS = frozenset({
    "$schema", "$id", "$ref", "$defs", "definitions", "type", "properties", "patternProperties",
    "additionalProperties", "required", "items", "prefixItems", "additionalItems", "enum", "const", "pattern",
    "format", "anyOf", "oneOf", "allOf", "not", "if", "then", "else", "minimum", "maximum", "exclusiveMinimum",
    "exclusiveMaximum", "multipleOf", "minLength", "maxLength", "minItems", "maxItems", "uniqueItems",
    "minProperties", "maxProperties", "dependentRequired", "dependentSchemas", "propertyNames", "contains",
    "title", "description", "default", "examples",
})


def schema_problem(schema: dict[str, Any]) -> str | None:
    """What makes `schema` unusable as a function's parameters (None: nothing): it is a JSON
    schema (checked against its draft's meta-schema), at most MAX_GUIDE_CHARS of JSON and
    MAX_SCHEMA_DEPTH levels deep, and it describes an object when it names a type. The answer is
    cached by the schema's JSON: the lines of a batch mostly share their tools, and the
    meta-schema check costs 1.6 ms a schema (0.01 ms cached)."""
    if _nesting(schema) > MAX_SCHEMA_DEPTH:
        return f"nests deeper than {MAX_SCHEMA_DEPTH} levels"
    try:
        text = json.dumps(schema, ensure_ascii=False)
    except (TypeError, ValueError):
        return "is not JSON"
    if len(text) > MAX_GUIDE_CHARS:
        return f"is {len(text)} characters of JSON; the limit is {MAX_GUIDE_CHARS}"
    return _checked_schema(text)


@lru_cache(maxsize=256)  # (at most 16 MiB of schema texts)
def _checked_schema(text: str) -> str | None:
    schema = json.loads(text)
    kind = schema.get("type")
    if kind is not None and kind != "object" and not (isinstance(kind, list) and "object" in kind):
        return "must describe a JSON object (type 'object')"
    import jsonschema  # (here: a large import that only tools need)

    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        # the rule and where, not jsonschema's message: that quotes the schema (user data, which
        # a failed row's message and the logs must not carry); property names masked as *
        where = "/".join(str(p) if isinstance(p, int) or p in _KEYWORDS else "*" for p in exc.path)[:120]
        return f"is not a valid JSON schema (the meta-schema's {exc.validator!r} rule fails at {where or 'its root'})"
    except Exception as exc:  # (hostile input: jsonschema's own errors are not all SchemaError, e.g. "$schema": 5)
        return f"is not a valid JSON schema ({type(exc).__name__})"
    return None


class FunctionDef(BaseModel):
    """One function a model may call: its name, what it does, and its arguments as a JSON schema."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: FunctionName = Field(description="1 to 64 letters, digits, underscores or dashes")
    description: str | None = Field(default=None, max_length=MAX_TOOL_DESCRIPTION_CHARS)
    parameters: dict[str, Any] | None = Field(
        default=None, description="the arguments' JSON schema (an object); none: the function takes no arguments"
    )
    strict: bool | None = Field(default=None, description="OpenAI's; arguments are always held to the schema "
                                "when the choice is required or this function")

    @field_validator("parameters")
    @classmethod
    def _a_schema(cls, v: dict[str, Any] | None) -> dict[str, Any] | None:
        if v is not None:
            problem = schema_problem(v)
            if problem is not None:
                raise PydanticCustomError("tool_parameters", "parameters {problem}", {"problem": problem})
        return v

    @property
    def arguments_schema(self) -> dict[str, Any]:
        """The schema its arguments must follow (its parameters, or an empty object)."""
        return NO_PARAMETERS if self.parameters is None else self.parameters


class Tool(BaseModel):
    """A tool the model may call (OpenAI's `{"type": "function", "function": {...}}`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: FunctionName


class NamedToolChoice(BaseModel):
    """`tool_choice` naming the one function the model must call."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class FunctionCall(BaseModel):
    """A call's function and arguments (a JSON text, as OpenAI's)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: FunctionName
    arguments: str = Field(max_length=MAX_GUIDE_CHARS, description="the arguments as JSON")


class ToolCall(BaseModel):
    """One call an assistant turn made (sent back in the conversation)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: Annotated[str, StringConstraints(min_length=1, max_length=200)]
    type: Literal["function"] = "function"
    function: FunctionCall


@dataclass(frozen=True, slots=True)
class ToolUse:
    """What reading a job's output needs of its tools: `mode` auto (parse the calls the model
    wrote, of the declared functions), required (the output is a JSON array of calls) or named
    (the output is the arguments of function `name`); `parallel`: more than one call allowed."""

    mode: Literal["auto", "required", "named"]
    names: frozenset[str]
    name: str | None = None
    parallel: bool = True


def tool_use(tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool = True) -> ToolUse | None:
    """The ToolUse of a job, or None when its output is plain text (no tools, or tool_choice none)."""
    if not tools or choice == "none":
        return None
    names = frozenset(t.function.name for t in tools)
    if isinstance(choice, NamedToolChoice):
        return ToolUse("named", names, choice.function.name, parallel)
    return ToolUse("required" if choice == "required" else "auto", names, None, parallel)


def tools_guide(tools: list[Tool], choice: ToolChoice | None, parallel: bool = True) -> GuidedDecoding | None:
    """The guided decoding that holds the output to the calls `choice` demands (None for auto and
    none). Raises ValueError when the spec is too large for guided decoding."""
    if isinstance(choice, NamedToolChoice):
        fn = next(t.function for t in tools if t.function.name == choice.function.name)
        return GuidedDecoding(kind="json_schema", json_schema=fn.arguments_schema)
    if choice != "required":
        return None
    calls = [{"type": "object",
              "properties": {"name": {"type": "string", "enum": [t.function.name]},
                             "parameters": t.function.arguments_schema},
              "required": ["name", "parameters"], "additionalProperties": False} for t in tools]
    array: dict[str, Any] = {"type": "array", "minItems": 1,
                             "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
    if not parallel:
        array["maxItems"] = 1
    return GuidedDecoding(kind="json_schema", json_schema=array)


def template_tools(tools: list[Tool] | None) -> list[dict[str, Any]] | None:
    """The tools as a chat template is given them (transformers' `tools`: the OpenAI dicts)."""
    return None if not tools else [t.model_dump(exclude_none=True) for t in tools]
