#!/usr/bin/env bash
# The suite again on the lowest Lightning that pyproject.toml declares (lightning==2.5.3), in .venv-lowest.
# Below 2.5 Lightning does not hand a loader's state back on a mid-epoch resume; 2.5.0-2.5.2's
# RichProgressBar breaks with rich 15 as soon as anything prints through it.
# The benchmarks are left out here (they run on the newest Lightning in scripts/test.sh).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
LOWEST=${DLTUNE_LOWEST_LIGHTNING:-lightning==2.5.3}
if [ ! -x .venv-lowest/bin/python ]; then
  "$PY" -m venv .venv-lowest
fi
LOG=.venv-lowest/dltune-install.log
: >"$LOG"
pip_install() {
  # quiet when it works; on failure, everything pip said
  .venv-lowest/bin/python -m pip install -q --disable-pip-version-check "$@" >>"$LOG" 2>&1 || {
    status=$?
    echo "test_lowest.sh: 'pip install $*' failed (exit $status); its output:" >&2
    cat "$LOG" >&2
    exit "$status"
  }
}
echo "test_lowest.sh: installing torch, $LOWEST and lightning-dltune into .venv-lowest (log: $LOG) ..."
pip_install --upgrade pip
pip_install "${DLTUNE_TORCH:-torch==2.13.0}" "$LOWEST"
pip_install -e ".[test,examples]" "$LOWEST"
.venv-lowest/bin/python -c "import lightning; print('lowest supported Lightning:', lightning.__version__)"
# the tier checks the package against this Lightning: the benchmark harnesses' tests, the policy's pure
# property tests (standard library only, no Lightning) and the loader machinery's tests on torch alone
# (marked torch_only) run in the newest tier alone
exec .venv-lowest/bin/python -m pytest -q -p no:cacheprovider -m "not torch_only" --ignore=tests/test_benchmarks.py \
  --ignore=tests/test_benchmark_oracle.py --ignore=tests/test_benchmark_phases.py \
  --ignore=tests/test_benchmark_targets.py --ignore=tests/test_gpu_benchmark.py \
  --ignore=tests/test_policy.py --ignore=tests/test_policy_windows.py "$@"
