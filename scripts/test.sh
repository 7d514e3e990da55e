#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check src tasks tests bench flows
# the docs site: a broken link, anchor or included file fails the build (site/ is git-ignored)
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --quiet --site-dir site
.venv/bin/python -m pytest "$@"
