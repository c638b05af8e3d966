#!/usr/bin/env bash
# Create the environment if needed, then run the whole test suite (CPU; GPU tests skip with a reason).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/env.sh)
# One BLAS/OpenMP thread per process: the suite starts servers, torchrun ranks and locust
# processes beside pytest, and oversubscribed 2-core machines slow to a crawl.
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
"$PY" -m ruff check .
"$PY" -m ruff format --check .
# config in pyproject.toml [tool.mypy]; about 25 s from a clean checkout, 3 s with .mypy_cache
"$PY" -m mypy
exec "$PY" -m pytest -q -p no:cacheprovider "$@"
