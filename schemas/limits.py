"""Hard limits on what one job (or one batch-file line) may hold, checked before it is queued.

They keep one input from costing the pipeline more than a job is worth (a 100 MB prompt, a
JSON document nested 10,000 deep) and make it that input's own error. The limits that depend on
the model (prompt tokens, prompt + max_tokens within the context) are checked at submission when
the model is known, and again by the engine.
"""

from __future__ import annotations

MAX_LINE_BYTES = 8 * 1024 * 1024  # one batch-file line or one POST /v1/jobs body
MAX_JSON_DEPTH = 32  # nesting of lists and objects in one line
MAX_PROMPT_CHARS = 1_000_000  # a prompt, or all chat turns together (past any context we serve)
MAX_MESSAGES = 10_000  # chat turns of one job
MAX_PROMPTS = 128  # prompts of one completions job (OpenAI's prompt list)
MAX_CHOICES = 128  # sequences one job runs: its prompts times best_of (or n)
MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 1_000  # one stop string
MAX_STOP_TOKEN_IDS = 1_024
MAX_TOKENS = 1 << 20  # max_tokens before the model's context is known
MAX_METADATA_BYTES = 16 * 1024  # the client's metadata, as JSON
MAX_METADATA_DEPTH = 8
MAX_LOGPROBS = 20  # alternatives reported per output token (OpenAI: top_logprobs <= 20)
MAX_LOGIT_BIAS = 1_024  # tokens one request may bias (OpenAI's logit_bias)
MAX_GUIDE_CHARS = 64 * 1024  # a guided-decoding spec (a JSON schema as JSON, a regex, the choices together)
MAX_GUIDE_CHOICES = 1_024  # guided_choice alternatives
MAX_TOOLS = 128  # functions one chat job may declare (OpenAI's limit)
MAX_TOOLS_CHARS = 512 * 1024  # all of them together, as JSON
MAX_TOOL_DESCRIPTION_CHARS = 8 * 1024  # one function's description
MAX_SCHEMA_DEPTH = 24  # nesting of one function's parameters schema (within MAX_JSON_DEPTH of the line)
MAX_TOOL_CALLS = 128  # calls one assistant turn of the conversation may carry
MAX_TOP_K = 1 << 20  # top_k before the model's vocabulary is known (the engine checks it against that)
# One job as a queue message (JSON): a line of MAX_LINE_BYTES and what the server adds to it. The
# producer's max_request_size and the broker's message.max.bytes are set to carry it (settings,
# scripts/services.sh, compose.yaml); a job that still does not fit is refused as too_large.
MAX_MESSAGE_BYTES = MAX_LINE_BYTES + 1024 * 1024
