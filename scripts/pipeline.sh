#!/usr/bin/env bash
# Set up the environment and run the stages on the embedded default (params.yaml).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
for stage in prepare_data prepare_model train; do
  echo "== $stage"
  .venv/bin/python -m "tasks.$stage" --params params.yaml
done
