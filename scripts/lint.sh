#!/usr/bin/env bash
# The linter and the formatter's check, as CI runs them (ruff; settings in pyproject.toml).
# `.venv/bin/ruff check --fix . && .venv/bin/ruff format .` applies what they ask for.
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/ruff check .
.venv/bin/ruff format --check .
