"""A job that cannot be one queue message is refused as too_large before it is published: a
prompt list of token ids counts too."""

from __future__ import annotations

from pipeline.producer import message_too_large
from schemas.job import ErrorCode, JobRequest
from schemas.limits import MAX_MESSAGE_BYTES


def test_a_prompt_list_of_token_ids_past_the_message_limit_is_too_large():
    big = JobRequest(prompts=[[2147483647] * 450_000, [2147483647] * 450_000])  # ~9.9 MB as JSON
    problem = message_too_large(big)
    assert problem is not None and problem[0] is ErrorCode.TOO_LARGE and str(MAX_MESSAGE_BYTES) in problem[1]
    assert message_too_large(JobRequest(prompts=[[1] * 1000, "a" * 1000])) is None
