"""Data-parallel step time: the train stage with ``num_processes`` 1 and 2 at the same global batch
(``prompts`` x ``group`` completions a step), each run exactly as DVC runs it
(``python -m tasks.train --params ...``), then the median per-step figures from its
``steps.jsonl`` (first step left out: warm-up), the stage's wall time, and the gradient
all-reduce's own cost (``time_allreduce_s``) beside the wait for the slower rank before it
(``time_wait_s``).

    python bench/data_parallel.py [--model DIR] [--processes 1 2] [--steps 6] [--prompts 4]
                                  [--group 4] [--new-tokens 16] [--threads N] [--json FILE]

Threads: by default one process uses torch's default (every core) and N processes get cores / N
each (the stage's launcher sets ``OMP_NUM_THREADS``); ``--threads`` sets it for every run.

Default model: a 2-layer random Llama (hidden 64, character tokenizer, as the tests use), built
in the output directory; ``--model models/base`` runs SmolLM2-135M. Rollouts come from the decode
loop (``rollout_backend: transformers``) in every run, so 1 and 2 processes sample the same
completions (per-completion seeds) and do the same work.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

from grpo.data import generate_arithmetic
from grpo.jsonio import write_jsonl

FIELDS = ("step_time_s", "time_generate_s", "time_update_s", "time_optimizer_s", "time_wait_s", "time_allreduce_s")


def tiny_model(path: Path) -> Path:
    """The tests' tiny random Llama at ``path`` (built once)."""
    from transformers import LlamaConfig

    from grpo.synthetic import char_tokenizer, random_model_dir

    if (path / "config.json").exists():
        return path
    cfg = LlamaConfig(vocab_size=len(char_tokenizer()), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    return random_model_dir(path, cfg, seed=0)


def run(out: Path, model: Path, n: int, args) -> dict:
    """One stage run with ``n`` processes; its median step figures and wall time."""
    run_dir = out / f"np{n}"
    params = {
        "model": {"path": str(model), "quantization": "nf4"},
        "lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "train": {"data_path": str(out / "train.jsonl"), "output_dir": str(run_dir / "out"),
                  "adapter_dir": str(run_dir / "adapter"), "metrics_dir": str(run_dir / "metrics"),
                  "steps": args.steps, "prompts_per_step": args.prompts, "group_size": args.group,
                  "max_new_tokens": args.new_tokens, "checkpoint_every": 0, "eval_every": 0,
                  "wandb_mode": "disabled", "rollout_backend": "transformers", "num_processes": n,
                  "temperature": 1.0},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "params.yaml").write_text(yaml.safe_dump(params))
    (run_dir / "out" / "steps.jsonl").unlink(missing_ok=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(run_dir / "params.yaml")], check=True,
                   capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    rows = [json.loads(line) for line in (run_dir / "out" / "steps.jsonl").read_text().splitlines()]
    timed = rows[1:] or rows
    threads = args.threads or (len(os.sched_getaffinity(0)) // n if n > 1 else "default")
    return {"processes": n, "threads": threads, "wall_s": wall, "steps": len(rows),
            **{k: statistics.median(r[k] for r in timed) for k in FIELDS},
            "completion_len": statistics.mean(r["completion_len"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model directory (default: the tiny random Llama)")
    ap.add_argument("--out", default="outputs/bench_data_parallel")
    ap.add_argument("--processes", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model).resolve() if args.model else tiny_model(out / "tiny-model")
    write_jsonl(out / "train.jsonl", generate_arithmetic(200, 0, max_digits=1))
    results = [run(out, model, n, args) for n in args.processes]
    print(f"model {model.name}, {args.prompts} prompts x G={args.group}, {args.new_tokens} new tokens, "
          f"{args.steps} steps (medians of steps 2..)")
    print("processes  threads  step_s  generate_s  update_s  optimizer_s  wait_s  allreduce_s  stage_wall_s")
    for r in results:
        print(f"{r['processes']:9d} {r['threads']!s:>8} {r['step_time_s']:7.2f} {r['time_generate_s']:11.2f} {r['time_update_s']:9.2f} "
              f"{r['time_optimizer_s']:12.4f} {r['time_wait_s']:7.4f} {r['time_allreduce_s']:12.5f} "
              f"{r['wall_s']:13.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
