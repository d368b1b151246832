"""Redis from scripts/services.sh answers (the Celery broker of the control plane)."""

from __future__ import annotations

import uuid

import pytest
import redis

pytestmark = pytest.mark.integration


def test_redis_round_trip(redis_url: str):
    client = redis.Redis.from_url(redis_url)
    key = f"firsttoken-test-{uuid.uuid4().hex}"
    client.set(key, b"v", ex=30)
    assert client.get(key) == b"v"
    client.delete(key)
