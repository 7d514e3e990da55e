"""SENT stage wall time through vLLM and through the transformers fallback, in one run.

Runs ``python -m tasks.sent`` twice on the same 256 training prompts (default model, M = 8,
64 new tokens), once per backend, each in a fresh process, and prints wall time, tokens/s and
the speed-up. Needs ``models/base`` (``python -m tasks.prepare_model``).

    python bench/sent_speed.py [--prompts 256] [--samples 8] [--tokens 64] [--dtype auto] [--out outputs/bench_sent]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from grpo.data import generate_arithmetic, split_disjoint  # noqa: E402
from grpo.jsonio import write_jsonl  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--prompts", type=int, default=256)
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--out", default="outputs/bench_sent")
    ap.add_argument("--backends", default="vllm,transformers")
    ap.add_argument("--dtype", default="auto", help="sent.dtype for both backends (auto, bfloat16, float32)")
    args = ap.parse_args()
    out = Path(args.out)
    rows, _, _ = split_disjoint(generate_arithmetic(2 * args.prompts, seed=7, max_digits=2, prefix="bench"), [])
    write_jsonl(out / "train.jsonl", rows[: args.prompts])
    results = {}
    for backend in args.backends.split(","):
        params = {
            "model": {"path": args.model},
            "sent": {"backend": backend, "data_path": str(out / "train.jsonl"),
                     "out_path": str(out / f"sorted_{backend}.jsonl"), "num_samples": args.samples,
                     "max_new_tokens": args.tokens, "dtype": args.dtype},
            "train": {"metrics_dir": str(out / backend)},
        }
        pfile = out / f"params_{backend}.yaml"
        pfile.write_text(yaml.safe_dump(params))
        t0 = time.perf_counter()
        subprocess.run([sys.executable, "-m", "tasks.sent", "--params", str(pfile)], check=True, cwd=ROOT)
        wall = time.perf_counter() - t0
        summary = json.loads((out / backend / "sent.json").read_text())
        results[backend] = {"process_wall_s": round(wall, 1), **summary}
    print(f"\nSENT stage, {args.prompts} prompts x M={args.samples}, <= {args.tokens} new tokens")
    print(f"{'backend':14} {'wall s':>8} {'setup s':>8} {'gen s':>8} {'tokens':>8} {'tok/s':>7} {'H mean':>7}")
    for name, r in results.items():
        print(f"{name:14} {r['process_wall_s']:8.1f} {r['setup_s']:8.1f} {r['generate_s']:8.1f} "
              f"{r['completion_tokens']:8d} {r['tokens_per_s']:7.1f} {r['entropy_mean']:7.3f}")
    if {"vllm", "transformers"} <= results.keys():
        ratio = results["transformers"]["process_wall_s"] / results["vllm"]["process_wall_s"]
        print(f"speed-up of vLLM over transformers (stage wall time): {ratio:.2f}x")
    (out / "results.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
