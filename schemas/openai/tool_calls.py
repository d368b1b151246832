"""Tool calls read out of a model's text, as it streams and whole: one incremental parser
(ToolCallParser) feeds both, so a streamed answer's chunks join into exactly the plain answer.

What the text holds, by the job's ToolUse (schemas.tools):
- named: the arguments of the one function (a JSON object, guided): one call, its arguments the
  text as it comes;
- required: a JSON array of `{"name": ..., "parameters": {...}}` (guided): a call per element,
  its arguments the raw text of `parameters`, streamed as it comes;
- auto: free text that may hold calls of the declared functions, Hermes / Qwen style
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks after some content, or a bare
  JSON object (or array of them) with `name` and `arguments` (or `parameters`). Content before the
  first block streams as it comes (a possible start of a tag held back); a bare JSON answer is held
  to the end. A text with no valid call of a declared function stays content, unchanged.

Events: ("content", text), ("call", index, id, name) then ("args", index, piece)...
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

from schemas.job import FinishReason
from schemas.tools import ToolUse

TAG, END_TAG = "<tool_call>", "</tool_call>"
_BLOCK = re.compile(r"<tool_call>(.*?)(?:</tool_call>|\Z)", re.DOTALL)

Event = tuple[Any, ...]


def call_id(job_id: str, choice: int, index: int) -> str:
    """The id of call `index` of a job's choice: OpenAI's `call_` form, the same every time the
    job's output is read (live, streamed, in a batch's output file)."""
    return "call_" + hashlib.blake2b(f"{job_id}\0{choice}\0{index}".encode(), digest_size=12).hexdigest()


def _arguments(obj: dict[str, Any]) -> str | None:
    """A written call's arguments as JSON text (None: not an object)."""
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
        except ValueError:
            return None
        return args if isinstance(parsed, dict) else None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def _written_calls(value: object, names: frozenset[str]) -> list[tuple[str, str]] | None:
    """(name, arguments) of a JSON value that is a call, or a list of calls, of declared functions."""
    items = value if isinstance(value, list) else [value]
    out = []
    for obj in items:
        if not isinstance(obj, dict) or obj.get("name") not in names or not set(obj) <= {"name", "arguments", "parameters"}:
            return None
        args = _arguments(obj)
        if args is None:
            return None
        out.append((obj["name"], args))
    return out or None


def _partial_tag(text: str) -> int:
    """Length of the longest end of `text` that begins the tag (held back: it may become one)."""
    for n in range(min(len(TAG) - 1, len(text)), 0, -1):
        if text.endswith(TAG[:n]):
            return n
    return 0


@dataclass
class _ArrayScan:
    """The state of a scan through a JSON array of `{"name": ..., "parameters": ...}` objects."""

    depth: int = 0  # open containers
    in_string: bool = False
    escape: bool = False
    key_start: int | None = None  # where the string being read at the item's level began
    key: str | None = None  # the item's key whose value is being read
    expect_value: bool = False  # after a key's colon
    value_start: int | None = None  # where that value began
    name: str | None = None  # the item's function name, once read
    args: list[str] = field(default_factory=list)  # its parameters' text not sent yet (no name yet)


class ToolCallParser:
    """Reads one choice's tool calls from its text as it grows (`feed`), then `finish` at its end.
    Every event either call returns goes to the client as it is (streamed) or is joined (plain)."""

    def __init__(self, use: ToolUse, job_id: str, choice: int = 0) -> None:
        self.use, self.job_id, self.choice = use, job_id, choice
        self.buf = ""
        self.calls = 0  # calls begun (their "call" event sent)
        self._sent = 0  # auto: characters of buf sent as content, or decided about
        self._state = "start"  # auto: start, text, held (a bare JSON answer), calls (a tag seen)
        self._scan = _ArrayScan()
        self._pos = 0  # required: characters scanned

    # -- events ---------------------------------------------------------------------------------

    def _begin(self, name: str) -> Event:
        self.calls += 1
        return ("call", self.calls - 1, call_id(self.job_id, self.choice, self.calls - 1), name)

    def feed(self, text: str) -> list[Event]:
        """The events `text` (the next piece of the output) completes."""
        self.buf += text
        if self.use.mode == "named":
            return self._feed_named()
        if self.use.mode == "required":
            return self._feed_required()
        return self._feed_auto()

    def finish(self) -> list[Event]:
        """The events of the end of the text: what was held back, decided now."""
        if self.use.mode == "named":
            return self._feed_named(final=True)
        if self.use.mode == "required":
            out = self._feed_required()
            if self.calls == 0 and self.buf:  # no call in it at all (a cut-off or broken array): it is content
                out.append(("content", self.buf))
            return out
        return self._finish_auto()

    # -- named: the text is the arguments ----------------------------------------------------

    def _feed_named(self, final: bool = False) -> list[Event]:
        out: list[Event] = []
        if self.calls == 0:
            if not self.buf.strip() and not final:
                return out  # leading blanks: not sent, not part of the arguments
            assert self.use.name is not None
            out.append(self._begin(self.use.name))
            self.buf = self.buf.lstrip()
            self._sent = 0
        if len(self.buf) > self._sent:
            out.append(("args", 0, self.buf[self._sent:]))
            self._sent = len(self.buf)
        return out

    # -- required: a JSON array of calls -----------------------------------------------------

    def _feed_required(self) -> list[Event]:
        out: list[Event] = []
        s, buf = self._scan, self.buf
        piece_from: int | None = None  # where this feed's run of parameters text began

        def flush_args(upto: int) -> None:
            nonlocal piece_from
            if piece_from is not None and upto > piece_from:
                if s.name is not None:
                    out.append(("args", self.calls - 1, buf[piece_from:upto]))
                else:
                    s.args.append(buf[piece_from:upto])
            piece_from = None

        def end_value(i: int) -> None:  # the value of s.key ended just before position i
            if s.key == "name" and s.value_start is not None:
                try:
                    name = json.loads(buf[s.value_start:i])
                except ValueError:
                    name = None
                if isinstance(name, str) and name in self.use.names and s.name is None:
                    s.name = name
                    out.append(self._begin(name))
                    if s.args:
                        out.append(("args", self.calls - 1, "".join(s.args)))
                        s.args = []
            elif s.key == "parameters":
                flush_args(i)
            s.key, s.value_start = None, None

        for i in range(self._pos, len(buf)):
            ch = buf[i]
            in_params = s.key == "parameters" and s.value_start is not None
            if in_params and piece_from is None:
                piece_from = i
            if s.in_string:
                if s.escape:
                    s.escape = False
                elif ch == "\\":
                    s.escape = True
                elif ch == '"':
                    s.in_string = False
                    if s.depth == 2 and s.key_start is not None:  # an item's key
                        try:
                            s.key = json.loads(buf[s.key_start:i + 1])
                        except ValueError:
                            s.key = None
                        s.key_start = None
                    elif s.depth == 2 and s.value_start is not None:  # a string value of the item
                        end_value(i + 1)
                continue
            if ch.isspace():
                continue
            if s.depth == 2 and s.expect_value:  # the item's value begins here
                s.expect_value = False
                s.value_start = i
                if s.key == "parameters":
                    piece_from = i
            if ch == '"':
                s.in_string = True
                if s.depth == 2 and s.value_start is None and s.key is None:
                    s.key_start = i
            elif ch in "[{":
                s.depth += 1
                if s.depth == 2:  # an item begins
                    s.name, s.args, s.key = None, [], None
            elif ch in "]}":
                if s.depth == 3 and s.value_start is not None:  # the item's container value closes
                    s.depth -= 1
                    end_value(i + 1)
                    continue
                if s.depth == 2 and s.value_start is not None:  # a scalar value ends at the item's end
                    end_value(i)
                s.depth -= 1
            elif ch == ":" and s.depth == 2 and s.key is not None and s.value_start is None:
                s.expect_value = True
            elif ch == "," and s.depth == 2 and s.value_start is not None:  # a scalar value ends
                end_value(i)
        self._pos = len(buf)
        if s.key == "parameters" and s.value_start is not None:
            flush_args(len(buf))
        return out

    # -- auto: calls the model chose to write ------------------------------------------------

    def _feed_auto(self) -> list[Event]:
        if self._state == "start":
            stripped = self.buf.lstrip()
            if not stripped:
                return []
            self._state = "held" if stripped[0] in "{[" else "text"
        if self._state != "text":
            return []
        at = self.buf.find(TAG, max(0, self._sent - len(TAG)))
        if at >= 0:
            self._state = "calls"
            end = at
        else:
            end = len(self.buf) - _partial_tag(self.buf)
        while end > self._sent and self.buf[end - 1].isspace():  # trailing blanks wait: they may precede a tag
            end -= 1
        if end <= self._sent:
            return []
        piece, self._sent = self.buf[self._sent:end], end
        return [("content", piece)]

    def _finish_auto(self) -> list[Event]:
        calls: list[tuple[str, str]] = []
        if self._state == "held":
            try:
                calls = _written_calls(json.loads(self.buf), self.use.names) or []
            except ValueError:
                calls = []
        elif self._state == "calls":
            for m in _BLOCK.finditer(self.buf, self._sent):
                try:
                    calls += _written_calls(json.loads(m.group(1)), self.use.names) or []
                except ValueError:
                    continue
        if not calls:  # no call: the rest is content, as written
            rest = self.buf[self._sent:]
            self._sent = len(self.buf)
            return [("content", rest)] if rest else []
        if not self.use.parallel:
            calls = calls[:1]
        out: list[Event] = []
        for name, args in calls:
            out.append(self._begin(name))
            out.append(("args", self.calls - 1, args))
        return out


def join_events(events: list[Event]) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a choice's events joined: the message a plain response carries
    (content None when there is none)."""
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for e in events:
        if e[0] == "content":
            content.append(e[1])
        elif e[0] == "call":
            calls.append({"id": e[2], "type": "function", "function": {"name": e[3], "arguments": ""}})
        else:
            calls[e[1]]["function"]["arguments"] += e[2]
    return ("".join(content) if content else None), calls


def parse_tool_calls(use: ToolUse, text: str, job_id: str, choice: int = 0) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output: its content without the calls (None when there is
    none) and OpenAI's tool_calls list (empty when the text holds no call)."""
    parser = ToolCallParser(use, job_id, choice)
    content, calls = join_events(parser.feed(text) + parser.finish())
    if not calls:
        return text, []
    return content, calls


def delta_of(event: Event) -> dict[str, Any]:
    """A chat chunk's `delta` for one event."""
    if event[0] == "content":
        return {"content": event[1]}
    if event[0] == "call":
        return {"tool_calls": [{"index": event[1], "id": event[2], "type": "function",
                                "function": {"name": event[3], "arguments": ""}}]}
    return {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}


def tool_finish(finish: FinishReason | None, has_calls: bool) -> str | None:
    """A choice's finish_reason: `tool_calls` when it called and ended by itself (by the end of
    its grammar or an end token), else its own (length: the calls may be cut off)."""
    if has_calls and finish is FinishReason.STOP:
        return "tool_calls"
    return None if finish is None else finish.value
