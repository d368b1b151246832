"""The formats of batch-file lines (and so of their output lines), and the OpenAI endpoint of each."""

from __future__ import annotations

from enum import StrEnum


class LineFormat(StrEnum):
    """The format of one input line, and so of its output line."""

    PLAIN = "plain"
    OPENAI_CHAT = "openai_chat"  # url /v1/chat/completions
    OPENAI_COMPLETIONS = "openai_completions"  # url /v1/completions


OPENAI_URLS = {
    "/v1/chat/completions": LineFormat.OPENAI_CHAT,
    "/v1/completions": LineFormat.OPENAI_COMPLETIONS,
}
