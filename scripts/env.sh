#!/usr/bin/env bash
# Create (or refresh) the project's virtual environment in .venv and print its python.
# Idempotent: reinstalls only when pyproject.toml changed since the last install.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
if [ ! -x "$VENV/bin/python" ]; then
  "$PY" -m venv "$VENV" >&2
fi
STAMP="$VENV/.installed-$(sha256sum pyproject.toml | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip >&2
  # torch first and pinned, so nothing later pulls a multi-GB CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" >&2
  "$VENV/bin/python" -m pip install -q -e ".[dev]" >&2
  NODEPS=$("$VENV/bin/python" -c 'import tomllib;print(" ".join(tomllib.load(open("pyproject.toml","rb"))["tool"]["dynrec"]["no-deps"]))')
  "$VENV/bin/python" -m pip install -q --no-deps $NODEPS >&2
  rm -f "$VENV"/.installed-*
  touch "$STAMP"
fi
echo "$VENV/bin/python"
