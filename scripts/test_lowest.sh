#!/usr/bin/env bash
# The suite again on the lowest Lightning that pyproject.toml declares (lightning==2.2.0), in .venv-lowest.
# Lightning 2.2 imports pkg_resources, which setuptools 81 removed: the venv keeps setuptools below 81.
# The benchmarks are left out here (they run on the newest Lightning in scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOWEST=${DLTUNE_LOWEST_LIGHTNING:-lightning==2.2.0}
if [ ! -x .venv-lowest/bin/python ]; then
  "$PY" -m venv .venv-lowest
fi
pip_install() { .venv-lowest/bin/python -m pip install -q --disable-pip-version-check "$@"; }
pip_install --upgrade pip
pip_install "${DLTUNE_TORCH:-torch==2.13.0}" "$LOWEST" "setuptools>=77,<81"
pip_install -e ".[test,examples]" "$LOWEST" "setuptools>=77,<81"
.venv-lowest/bin/python -c "import lightning; print('lowest supported Lightning:', lightning.__version__)"
exec .venv-lowest/bin/python -m pytest -q -p no:cacheprovider --ignore=tests/test_benchmarks.py "$@"
