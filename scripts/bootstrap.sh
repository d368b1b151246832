#!/usr/bin/env bash
# Create the project-local virtual environment (.venv) and install firsttoken into it.
# Idempotent: an existing .venv is reused, and pip runs again only when pyproject.toml changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if ! "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))'; then
  echo "firsttoken needs Python 3.11+ (found $("$PY" --version 2>&1))" >&2
  exit 1
fi
if [ ! -x .venv/bin/python ]; then
  echo "creating .venv"
  "$PY" -m venv .venv
fi
stamp=.venv/.firsttoken-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ]; then
  echo "installing firsttoken and its dependencies into .venv (torch is a large first download)"
  .venv/bin/python -m pip install -q --upgrade pip
  .venv/bin/python -m pip install -q -e ".[dev]"
  echo "$want" > "$stamp"
fi
