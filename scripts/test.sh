#!/usr/bin/env bash
# The whole test suite from a fresh machine: install into .venv, start the real services the
# integration tests need (Kafka, Postgres, Redis, on loopback), run pytest, stop the services.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/bootstrap.sh
started=0
if [ -x scripts/services.sh ] && [ "${FIRSTTOKEN_SKIP_SERVICES:-0}" != 1 ]; then
  scripts/services.sh start
  started=1
  # shellcheck disable=SC1091
  eval "$(scripts/services.sh env)"
  # The integration tests fail (instead of skipping) when a service's variable is missing.
  export FIRSTTOKEN_REQUIRE_SERVICES=1
fi
cleanup() { if [ "$started" = 1 ]; then scripts/services.sh stop || true; fi; }
trap cleanup EXIT
.venv/bin/python -m pytest "$@"
