"""The job queue: Kafka in the distributed mode, in-process in the embedded one."""

from pipeline.queue.base import (
    DLQ_ERROR,
    DLQ_ERROR_CODE,
    DLQ_ORIGIN_OFFSET,
    DLQ_ORIGIN_PARTITION,
    DLQ_ORIGIN_TOPIC,
    JobConsumer,
    JobQueue,
    Message,
    encode_job,
    routing_key,
)
from pipeline.queue.local import LocalQueue
from pipeline.queue.offsets import OffsetTracker

__all__ = [
    "DLQ_ERROR",
    "DLQ_ERROR_CODE",
    "DLQ_ORIGIN_OFFSET",
    "DLQ_ORIGIN_PARTITION",
    "DLQ_ORIGIN_TOPIC",
    "JobConsumer",
    "JobQueue",
    "LocalQueue",
    "Message",
    "OffsetTracker",
    "encode_job",
    "routing_key",
]
# KafkaQueue lives in pipeline.queue.kafka (imports kafka-python): `from pipeline.queue.kafka import KafkaQueue`.
