#!/usr/bin/env bash
# Set up .venv and run the whole pipeline with DVC (`dvc repro`) on the embedded default; on a machine
# with nvidia-smi, `grpo doctor` checks it for the GPU run first.
#   bash scripts/pipeline.sh                        # params.yaml (offline, CPU)
#   bash scripts/pipeline.sh presets/seed003.yaml   # put a preset's keys over params.yaml first (GPU + internet)
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v git >/dev/null 2>&1; then
  # DVC keeps experiments and the lock file's history in git; the workspace must be a repository
  echo "pipeline: error: git is not installed; install it (Debian/Ubuntu: apt-get install git)" >&2
  exit 1
fi
bash scripts/setup.sh
export PATH="$PWD/.venv/bin:$PATH"   # dvc.yaml runs `python -m tasks.<stage>` with this venv
if [ $# -ge 1 ]; then
  python scripts/apply_preset.py "$1" params.yaml
fi
if ! git rev-parse --git-dir >/dev/null 2>&1; then
  git init -q && git add -A && git -c user.email=grpo@localhost -c user.name=grpo commit -qm "pipeline workspace"
fi
if command -v nvidia-smi >/dev/null 2>&1; then
  # a GPU machine: stop here with one line (exit 2) if the driver, card, compiler, Python headers or
  # the FlashInfer sampler setting would fail a stage later (grpo.rollout.engine.preflight)
  python -m grpo.tools.cli doctor --params params.yaml
fi
dvc repro
echo "pipeline: done; see reports/report.html (offline) and metrics/headline.json. Next, in any shell:"
echo "  source .venv/bin/activate          # once a shell: python, grpo and dvc are the project's"
echo "  python -m grpo.evaluation.experiments table   # experiments: accuracies and what each changed"
