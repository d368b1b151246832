.PHONY: run test lint install

install:
	scripts/bootstrap.sh

# The main job on the embedded default: no services, tiny random model, on CPU.
run: install
	.venv/bin/firsttoken run examples/prompts.jsonl --model tiny --max-tokens 16

# The whole suite: installs, starts real Kafka/Postgres/Redis, runs pytest, stops them.
test:
	scripts/test.sh

lint: install
	.venv/bin/ruff check .
