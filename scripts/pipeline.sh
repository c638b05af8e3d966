#!/usr/bin/env bash
# The main job: create the environment if needed, then run the train-then-serve pipeline
# (synthetic `small` data by default; no GPU, no download). Arguments go to scripts/pipeline.py.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=$(bash scripts/env.sh)
exec "$PY" scripts/pipeline.py "$@"
