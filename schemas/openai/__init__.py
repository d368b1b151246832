"""The OpenAI protocol, in one package: line formats and endpoints (`formats`), request bodies
to JobInput fields (`requests`), results to response bodies and batch output lines
(`responses`), streamed chunks (`stream`) and error bodies with OpenAI's types (`errors`)."""

from schemas.openai.errors import HTTP_STATUS, error_body, error_type
from schemas.openai.formats import OPENAI_URLS, LineFormat
from schemas.openai.requests import openai_body_request
from schemas.openai.responses import (
    choice_logprobs,
    echo_prompt,
    firsttoken_extension,
    format_output_line,
    openai_choice,
    openai_logprobs,
    openai_output,
    openai_response,
    openai_usage,
    plain_output,
    result_choices,
)

__all__ = [
    "HTTP_STATUS",
    "OPENAI_URLS",
    "LineFormat",
    "choice_logprobs",
    "echo_prompt",
    "error_body",
    "error_type",
    "firsttoken_extension",
    "format_output_line",
    "openai_body_request",
    "openai_choice",
    "openai_logprobs",
    "openai_output",
    "openai_response",
    "openai_usage",
    "plain_output",
    "result_choices",
]
