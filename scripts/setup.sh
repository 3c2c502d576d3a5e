#!/usr/bin/env bash
# Creates .venv in the checkout (if missing) and installs lightning-dltune with its test and example extras.
# torch is installed first, pinned by DLTUNE_TORCH (default torch==2.13.0) so that the other
# dependencies' ranges are met by it instead of pulling another build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "${DLTUNE_TORCH:-torch==2.13.0}"
.venv/bin/python -m pip install -q -e ".[test,examples,bench]"
