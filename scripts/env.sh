#!/usr/bin/env bash
# Create (or rebuild) the project's virtual environment in .venv from requirements/lock.txt, and
# print its python. Idempotent: the venv's stamp is a hash of the lock, pyproject.toml and this
# script; when any of them changes, the venv is deleted and built again, so `pip freeze` of it is
# always exactly the lock (plus the editable project). Regenerate the lock with scripts/lock.sh.
#
# The lock is for CPython 3.11 on Linux x86_64. torch's CPU build (torch==2.13.0+cpu) comes from the
# pip configuration of this machine (/opt/wheels); elsewhere, point pip at PyTorch's CPU index:
#   PIP_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/env.sh
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
PY=${PYTHON:-python3}
LOCK=requirements/lock.txt
if ! "$PY" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))'; then
  echo "env.sh: $LOCK is for CPython 3.11, but $PY is $("$PY" -V 2>&1); set PYTHON=python3.11" >&2
  exit 1
fi
STAMP="$VENV/.installed-$(cat "$LOCK" pyproject.toml scripts/env.sh | sha256sum | cut -c1-16)"
if [ ! -f "$STAMP" ]; then
  if [ -e "$VENV" ]; then
    [ -f "$VENV/pyvenv.cfg" ] || { echo "env.sh: $VENV exists and is not a venv; remove it" >&2; exit 1; }
    echo "env.sh: $LOCK, pyproject.toml or env.sh changed: rebuilding $VENV" >&2
    rm -rf "$VENV"
  fi
  "$PY" -m venv "$VENV" >&2
  # Exactly the lock: no resolution, every file checked against its hash. The build backend
  # (setuptools) is in the lock too, so the editable install needs no isolated build environment.
  # (this machine's pip.conf names local file:// indexes that lack most packages; pip warns once
  # per package and index, 250 lines that say nothing: they are dropped, every other line kept)
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --require-hashes \
    -r "$LOCK" 2> >(grep -v "^WARNING: Location 'file://" >&2) >&2
  "$VENV/bin/python" -m pip install -q --disable-pip-version-check --no-deps --no-build-isolation \
    -e . 2> >(grep -v "^WARNING: Location 'file://" >&2) >&2
  touch "$STAMP"
fi
echo "$VENV/bin/python"
