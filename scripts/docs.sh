#!/usr/bin/env bash
# The docs site: mkdocs.yml's pages and the reference rendered from the docstrings, built --strict (a broken
# link between pages or a missing reference fails it). `.venv/bin/python -m mkdocs serve` serves it live.
set -euo pipefail
cd "$(dirname "$0")/.."
export NO_MKDOCS_2_WARNING=1   # Material's banner about MkDocs 2, printed on every build
.venv/bin/python -m mkdocs build --strict --site-dir "${DLTUNE_SITE_DIR:-site}"
