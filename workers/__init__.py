"""The GPU side of firsttoken: Celery worker, Kafka intake, result sink, and the engine."""
