#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/python -m ruff check src tasks tests bench flows
.venv/bin/python -m pytest "$@"
