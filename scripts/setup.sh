#!/usr/bin/env bash
# Creates .venv in the checkout (if missing) and installs lightning-dltune with its test and example extras.
# torch is installed first, pinned by DLTUNE_TORCH (default torch==2.13.0) so that the other
# dependencies' ranges are met by it instead of pulling another build.
#
# Quiet when it works: pip's output (and setuptools' build warnings) go to .venv/dltune-install.log,
# which is printed in full if a step fails. The install is skipped while pyproject.toml and
# DLTUNE_TORCH are unchanged since the last one (the package is installed editable, so code changes
# need no reinstall); DLTUNE_REINSTALL=1 forces it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH=${DLTUNE_TORCH:-torch==2.13.0}
LOG=.venv/dltune-install.log
STAMP=.venv/dltune-installed

if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
wanted="$TORCH $(cksum < pyproject.toml)"
if [ "${DLTUNE_REINSTALL:-0}" != 1 ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$wanted" ]; then
  exit 0
fi

run() {
  # one install step; on failure, everything pip said, then its exit status
  "$@" >>"$LOG" 2>&1 || {
    status=$?
    echo "setup.sh: '$*' failed (exit $status); its output:" >&2
    cat "$LOG" >&2
    exit "$status"
  }
}

: >"$LOG"
rm -f "$STAMP"
echo "setup.sh: installing lightning-dltune into .venv (log: $LOG) ..."
export PIP_DISABLE_PIP_VERSION_CHECK=1
run .venv/bin/python -m pip install -q --upgrade pip
run .venv/bin/python -m pip install -q "$TORCH"
run .venv/bin/python -m pip install -q -e ".[test,examples,bench,dev]"
echo "$wanted" >"$STAMP"
echo "setup.sh: done."
