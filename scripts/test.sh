#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
# --fast: only the fast tier (-m "not slow": unit tests and tiny in-process runs) for the inner loop.
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=()
if [[ "${1:-}" == "--fast" ]]; then fast=(-m "not slow"); shift; fi
bash scripts/setup.sh
# the optional ZeRO path is tested too (tests/test_zero.py): the `deepspeed` extra of pyproject.toml
if ! .venv/bin/python -c 'import importlib.util, sys; sys.exit(importlib.util.find_spec("deepspeed") is None)'; then
  .venv/bin/python -m pip install -q -e ".[deepspeed]"
fi
.venv/bin/python -m ruff check src tasks tests bench flows
# the docs site: a broken link, anchor or included file fails the build (site/ is git-ignored)
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --quiet --site-dir site
.venv/bin/python -m pytest "${fast[@]}" "$@"
