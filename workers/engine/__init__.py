"""The inference engine: continuous batching over a paged KV cache with prefix reuse.

Public entry points: `LLMEngine` (add_request / abort / step / stats) and the offline helper `LLM`.
Nothing here knows about queues or databases.
"""

from workers.engine.config import EngineConfig, ModelConfig
from workers.engine.engine import LLMEngine
from workers.engine.errors import InvalidRequestError
from workers.engine.llm import LLM
from workers.engine.outputs import FinishedRequest, FirstTokenEvent, StepOutput

__all__ = [
    "LLM",
    "EngineConfig",
    "FinishedRequest",
    "FirstTokenEvent",
    "InvalidRequestError",
    "LLMEngine",
    "ModelConfig",
    "StepOutput",
]
