#!/usr/bin/env bash
# Create .venv and install the project with pinned versions (idempotent; a second run is quick).
# CPU machines: `pip install torch==2.13.0` takes the CPU build; CUDA machines get the CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install -q --upgrade pip
.venv/bin/python -m pip install -q "torch==2.13.0"
.venv/bin/python -m pip install -q -e ".[dev]"
echo "setup: done ($(.venv/bin/python -c 'import torch, transformers, peft, bitsandbytes, triton; print(f"torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, bitsandbytes {bitsandbytes.__version__}, triton {triton.__version__}")'))"
