#!/usr/bin/env bash
# Create the environment if needed, then run the whole test suite (CPU; GPU tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/env.sh)
"$PY" -m ruff check .
"$PY" -m ruff format --check .
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
