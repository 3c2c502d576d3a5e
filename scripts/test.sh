#!/usr/bin/env bash
# The test suite: set up, then run every test (real CPU fits, a 2-process DDP run, a TensorBoard server).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q "$@"
