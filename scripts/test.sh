#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
# --fast: only the fast tier (-m "not slow": unit tests and tiny in-process runs) for the inner loop.
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=()
if [[ "${1:-}" == "--fast" ]]; then fast=(-m "not slow"); shift; fi
bash scripts/setup.sh
.venv/bin/python -m ruff check src tasks tests bench flows
.venv/bin/python -m pytest "${fast[@]}" "$@"
