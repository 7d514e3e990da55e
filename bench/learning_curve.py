"""Does GRPO learn? Train SmolLM2-135M-Instruct (4-bit + LoRA) on 1-digit addition from
reasoning-gym with the train section of params.yaml, then print the per-step correctness curve,
the mean of the first and last 10 steps, the wall time, and save a PNG of the curve.

    python bench/learning_curve.py [--params params.yaml] [--out outputs/bench_learning]

Needs ``models/base`` (``python -m tasks.prepare_model``).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

from grpo.data import generate_arithmetic
from grpo.jsonio import write_jsonl


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="params.yaml")
    ap.add_argument("--out", default="outputs/bench_learning")
    ap.add_argument("--problems", type=int, default=400)
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "train.jsonl", generate_arithmetic(args.problems, 0, max_digits=1))
    params = yaml.safe_load(Path(args.params).read_text())
    params.pop("data", None)
    params["train"].update(
        data_path=str(out / "train.jsonl"),
        output_dir=str(out / "run"),
        adapter_dir=str(out / "adapter"),
        metrics_dir=str(out / "metrics"),
        checkpoints={**params["train"]["checkpoints"], "every": 0},
        wandb={**params["train"]["wandb"], "mode": "disabled"},
    )
    (out / "params.yaml").write_text(yaml.safe_dump(params))
    if (out / "run" / "steps.jsonl").exists():
        (out / "run" / "steps.jsonl").unlink()
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(out / "params.yaml")], check=True)
    wall = time.perf_counter() - start
    rows = [json.loads(line) for line in (out / "run" / "steps.jsonl").read_text().splitlines()]
    acc = [r["rollout_accuracy"] for r in rows]
    first, last = sum(acc[:10]) / len(acc[:10]), sum(acc[-10:]) / len(acc[-10:])
    print("step accuracy completion_len step_time_s")
    for r in rows:
        print(f"{r['step']:4d} {r['accuracy']:8.3f} {r['completion_len']:14.1f} {r['step_time_s']:11.1f}")
    print(f"first 10 steps: {first:.3f}  last 10 steps: {last:.3f}  gain: {last - first:+.3f}  wall: {wall:.0f} s")

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.5))
    ax.plot([r["step"] for r in rows], acc, marker="o", ms=3, label="correctness (per step)")
    k = 5
    smooth = [sum(acc[max(0, i - k + 1) : i + 1]) / len(acc[max(0, i - k + 1) : i + 1]) for i in range(len(acc))]
    ax.plot([r["step"] for r in rows], smooth, lw=2, label=f"{k}-step mean")
    ax.set_xlabel("step")
    ax.set_ylabel("mean correctness reward")
    ax.set_ylim(0, 1)
    ax.legend()
    fig.tight_layout()
    fig.savefig(out / "learning_curve.png", dpi=120)
    print(f"plot: {out / 'learning_curve.png'}")


if __name__ == "__main__":
    main()
