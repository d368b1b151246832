"""Server-sent events of a streamed OpenAI (chat) completion: the chunks, their `data:` framing,
and the text of a delta message not sent yet."""

from __future__ import annotations

import json
from typing import Any

from schemas.openai.errors import error_body
from schemas.openai.formats import LineFormat

DONE = b"data: [DONE]\n\n"


def completion_chunk(job_id: str, fmt: LineFormat, model: str, created: int, text: str | None,
                     finish: str | None, role: bool = False, index: int = 0) -> dict[str, Any]:
    """One chunk of choice `index`: a chat `delta` (with the role in the first) or a text
    completion's `text`."""
    if fmt is LineFormat.OPENAI_CHAT:
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta, "finish_reason": finish, "logprobs": None}
        return {"id": "chatcmpl-" + job_id, "object": "chat.completion.chunk", "created": created, "model": model,
                "choices": [choice]}
    choice = {"index": index, "text": text or "", "finish_reason": finish, "logprobs": None}
    return {"id": "cmpl-" + job_id, "object": "text_completion", "created": created, "model": model, "choices": [choice]}


def sse(obj: dict[str, Any]) -> bytes:
    """One event."""
    return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def error_event(code: str, message: str, *, status: int = 500) -> bytes:
    """An error in the stream (its HTTP status was sent already: `status` only picks the type)."""
    return sse(error_body(code, message, status=status))


def stream_text(sent: str, msg: dict[str, Any]) -> str:  # (of the delta's choice: msg["index"], 0 if absent)
    """The part of a delta message not sent yet: a job redelivered to another worker streams again
    from its start, and its deltas then repeat text the client has (dropped by their offsets)."""
    text, offset = msg["text"], msg.get("offset", len(sent))
    if offset > len(sent):  # a delta missed in between: wait for the final text to fill the gap
        return ""
    return text[len(sent) - offset :] if offset + len(text) > len(sent) else ""
