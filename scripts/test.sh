#!/usr/bin/env bash
# Set up the environment and run the whole test suite (what CI runs).
# --fast: only the fast tier (-m "not slow": unit tests and tiny in-process runs) for the inner loop,
# spread over the machine's cores (pytest-xdist; the full tier runs in one process: its servers,
# queues and multi-process runs time themselves against the whole machine).
# Other arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
fast=()
if [[ "${1:-}" == "--fast" ]]; then fast=(-m "not slow" -n auto); shift; fi
# with the `deepspeed` extra of pyproject.toml: the optional ZeRO path is tested too (tests/test_zero.py)
bash scripts/setup.sh deepspeed
.venv/bin/python -m ruff check src tasks tests bench flows
# the docs site: a broken link, anchor or included file fails the build (site/ is git-ignored)
NO_MKDOCS_2_WARNING=1 .venv/bin/python -m mkdocs build --strict --quiet --site-dir site
.venv/bin/python -m pytest "${fast[@]}" "$@"
