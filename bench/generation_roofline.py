"""How fast can rollouts be on this machine? The engine and the decode loop against the matmul floor.

    python bench/generation_roofline.py [--model models/base] [--prompts 4] [--group 8] [--new-tokens 64]

At one decoding step every one of the ``B = prompts x group`` sequences passes one token through
every linear layer of the model, so a step costs at least the time of the model's matmuls at
``M = B`` rows: ``floor_ms``, measured here with plain fp32 ``torch.matmul`` over the model's own
weight shapes (attention over the cache, sampling and the engine's bookkeeping come on top). Then
both rollout backends sample ``B`` completions of exactly ``new-tokens`` tokens (EOS suppressed, so
both decode the same number of steps) from the same prompts, and the script prints per backend its
milliseconds per decoding step, tokens per second and share of the floor's rate, and the largest
speed-up over the decode loop that any sampler could reach at this batch if it ran at the floor.

The dtype is the one both backends compute in, ``grpo.device.compute_dtype("auto")`` (fp32 on
CPUs). Each backend runs in its own process (``--only``), as the train stage holds one of them.
Prints figures only; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def linear_shapes(config: dict) -> list[tuple[int, int]]:
    """(in, out) of every matmul one token passes through: per layer q/k/v, o, gate/up, down; the LM head."""
    h, inter = config["hidden_size"], config["intermediate_size"]
    kv = config["num_key_value_heads"] * (h // config["num_attention_heads"])
    per_layer = [(h, h + 2 * kv), (h, h), (h, 2 * inter), (inter, h)]
    return per_layer * config["num_hidden_layers"] + [(h, config["vocab_size"])]


def matmul_floor(shapes: list[tuple[int, int]], rows: int, dtype, repeat: int = 10) -> float:
    """Seconds for one decoding step's matmuls at ``rows`` rows (median of ``repeat`` after a warm-up)."""
    import torch

    weights = [torch.randn(k, n, dtype=dtype) for k, n in shapes]
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k, _ in shapes}
    times = []
    for i in range(repeat + 2):
        t0 = time.perf_counter()
        for w in weights:
            inputs[w.shape[0]] @ w
        if i >= 2:
            times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


def prompts_for(tokenizer, n: int) -> list[str]:
    from grpo.data import build_prompt
    from grpo.sections.shared import DEFAULT_SYSTEM_PROMPT

    return [build_prompt(tokenizer, f"What is {17 * i + 3} + {29 * i + 11}?", DEFAULT_SYSTEM_PROMPT) for i in range(n)]


def run_backend(args, which: str) -> dict:
    """Sample ``prompts x group`` fixed-length completions with one backend; seconds per call."""
    import torch

    from grpo.base_model import load_tokenizer
    from grpo.engine.policy_engine import policy_rollouts
    from grpo.lora_policy import load_policy
    from grpo.sections.engine import VLLMEngineConfig
    from grpo.sections.lora import LoraConfig
    from grpo.sections.model import ModelConfig

    tok = load_tokenizer(args.model)
    model = load_policy(ModelConfig(path=args.model), LoraConfig(rank=16, alpha=32))
    fixed = dict(min_new_tokens=args.new_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        backend = policy_rollouts("vllm" if which == "engine" else "transformers", tok, model,
                                  base=ModelConfig(path=args.model), engine_dir=Path(tmp) / "engine",
                                  section=VLLMEngineConfig(gpu_memory_utilization=0.3, max_model_len=1024), **fixed)
        backend.sync(model)  # the engine holds the policy; nothing to do for the decode loop
        prompts = prompts_for(tok, args.prompts)
        times = []
        for i in range(args.repeat + 1):  # the first call warms up
            torch.manual_seed(i)
            t0 = time.perf_counter()
            rollout = backend.generate(prompts, args.group, max_new_tokens=args.new_tokens, temperature=1.0)
            if i:
                times.append(time.perf_counter() - t0)
        tokens = int(rollout.completion_mask.sum())
        backend.close()
    return {"backend": which, "seconds": sorted(times)[len(times) // 2], "tokens": tokens, "calls": times}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=2, help="timed calls per backend, after one warm-up call")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--only", choices=["engine", "decode-loop"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    sys.path.insert(0, str(REPO / "src"))

    if args.only:
        print(json.dumps(run_backend(args, args.only)))
        return

    import torch

    from grpo.device import compute_dtype

    rows, steps = args.prompts * args.group, args.new_tokens
    dtype = compute_dtype("auto", "cpu")
    shapes = linear_shapes(json.loads((Path(args.model) / "config.json").read_text()))
    gflop_per_token = sum(2 * k * n for k, n in shapes) / 1e9
    floor = matmul_floor(shapes, rows, dtype)
    print(f"{args.model}: {rows} sequences x {steps} tokens, {dtype}, {torch.get_num_threads()} threads; "
          f"{gflop_per_token:.3f} GFLOP of matmuls per token", flush=True)
    print(f"matmul floor: {floor * 1e3:.1f} ms per decoding step at {rows} rows = {rows / floor:.0f} tok/s "
          f"({gflop_per_token * rows / floor:.1f} GFLOP/s)", flush=True)
    results = {"rows": rows, "steps": steps, "dtype": str(dtype), "floor_ms": floor * 1e3,
               "floor_tok_s": rows / floor, "gflop_per_token": gflop_per_token}
    for which in ("engine", "decode-loop"):
        cmd = [sys.executable, __file__, "--only", which, "--model", args.model, "--prompts", str(args.prompts),
               "--group", str(args.group), "--new-tokens", str(steps), "--repeat", str(args.repeat)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode:
            raise SystemExit(f"{which} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        r = json.loads(proc.stdout.strip().splitlines()[-1])
        step_ms = r["seconds"] / steps * 1e3
        r.update(step_ms=step_ms, tok_s=r["tokens"] / r["seconds"], share_of_floor=floor * 1e3 / step_ms)
        results[which] = r
        print(f"{which:<12} {r['seconds']:6.2f} s  {step_ms:6.1f} ms/step  {r['tok_s']:6.0f} tok/s  "
              f"{100 * r['share_of_floor']:4.0f}% of the floor's rate", flush=True)
    loop = results["decode-loop"]["step_ms"]
    results["max_speedup_at_floor"] = loop / (floor * 1e3)
    print(f"engine / decode loop: {loop / results['engine']['step_ms']:.2f}x; a sampler at the matmul floor "
          f"would be {results['max_speedup_at_floor']:.2f}x the decode loop at this batch")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
