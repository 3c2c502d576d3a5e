#!/usr/bin/env bash
# The main job: set up, then run the demo (a JPEG pipeline started at num_workers=0, tuned between epochs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/dltune fit --config configs/demo.yaml "$@"
