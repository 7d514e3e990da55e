"""Peak memory of one GRPO training forward+backward, with and without the entropy mask.

Runs the trainer's own micro-batch path (``grpo.passes.PolicyPasses.loss_backward``) on the base model
at ``models/base`` (4-bit NF4 + LoRA) with N completions of T tokens, once per mask setting,
each in a fresh process so that one measurement cannot inherit the other's high-water mark.

Peak memory: on CUDA ``torch.cuda.max_memory_allocated`` over the forward+backward; on the CPU the
peak resident-set growth over the same span (a sampler thread reads /proc/self/statm every
2 ms; workers run with ``MALLOC_MMAP_THRESHOLD_=1MiB`` so that freed tensors go back to the OS
and RSS follows live tensor memory).

    python bench/entropy_memory.py                      # SmolLM2, 16 x 256, mask 0.2 vs none
    python bench/entropy_memory.py --completions 4 --tokens 32 --model <dir>   # toy size
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from _memory import CPU_MALLOC_ENV, RssPeak


def measure(model_dir: str, quantile: float, completions: int, tokens: int, prompt_tokens: int) -> dict:
    import torch

    from grpo.device import default_device
    from grpo.loss import group_advantages, loss_normalizer
    from grpo.params import AllParams
    from grpo.trainer_builder import build_trainer, depart
    from grpo.types import TrainBatch

    device = default_device()
    changes = {"model.path": model_dir, "train.rollouts.group_size": completions, "train.loss.entropy_rule": "high",
               "train.loss.entropy_rule_options.high.top_quantile": quantile,
               "train.rollouts.max_new_tokens": tokens, "train.rollouts.backend": "transformers"}
    built = build_trainer(depart(AllParams(), changes), device, problems=[{"id": "p0", "question": "", "answer": "0"}])
    trainer, model, cfg = built.trainer, built.model, built.trainer.cfg
    vocab = model.get_base_model().config.vocab_size
    ids = torch.randint(100, min(vocab, 30000), (completions, prompt_tokens + tokens), device=device)
    attn = torch.ones_like(ids)
    targets, mask = ids[:, prompt_tokens:], torch.ones(completions, tokens, dtype=torch.long, device=device)
    adv = group_advantages(torch.arange(completions, dtype=torch.float32), completions).to(device)
    norm = loss_normalizer(mask, cfg.loss.loss_type)
    model.train()
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    with RssPeak() as rss:
        _, _, _, keep = trainer.passes.loss_backward(TrainBatch(ids, attn, targets, mask, adv, prompt_tokens), norm)
    seconds = time.perf_counter() - t0
    out = {
        "quantile": quantile,
        "kept_frac": float(keep.float().mean()),
        "seconds": seconds,
        "rss_growth_mb": rss.growth / 2**20,
        "device": device,
    }
    if device == "cuda":
        out["cuda_peak_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
        out["cuda_peak_growth_mb"] = (torch.cuda.max_memory_allocated() - base) / 2**20
    out["peak_mb"] = out.get("cuda_peak_growth_mb", out["rss_growth_mb"])
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/base", help="base model directory (prepare_model's output)")
    ap.add_argument("--completions", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=256, help="completion tokens per sequence")
    ap.add_argument("--prompt-tokens", type=int, default=64)
    ap.add_argument("--quantiles", default="0.2,1.0", help="entropy_top_quantile values; 1.0 = no mask")
    ap.add_argument("--worker", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        print(json.dumps(measure(args.model, args.worker, args.completions, args.tokens, args.prompt_tokens)))
        return
    results = []
    for q in (float(x) for x in args.quantiles.split(",")):
        cmd = [sys.executable, __file__, "--worker", str(q), "--model", args.model, "--completions",
               str(args.completions), "--tokens", str(args.tokens), "--prompt-tokens", str(args.prompt_tokens)]
        # blocks of 1 MB or more are mmap'd, so freeing them returns them to the OS at once and RSS
        # follows live tensor memory instead of glibc's arena high-water mark
        env = {**os.environ, **CPU_MALLOC_ENV}
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, env=env)
        if proc.returncode:
            sys.exit(f"worker for quantile {q} failed:\n{proc.stderr[-3000:]}")
        results.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    print(f"model {args.model}: {args.completions} completions x {args.tokens} tokens (+{args.prompt_tokens} prompt)")
    print(f"{'mask':>10} {'kept':>6} {'peak MB':>9} {'seconds':>8}")
    for r in results:
        label = "none" if r["quantile"] >= 1 else f"top {r['quantile']:.0%}"
        print(f"{label:>10} {r['kept_frac']:6.2f} {r['peak_mb']:9.1f} {r['seconds']:8.2f}")
    if len(results) == 2:
        print(f"masked / unmasked peak: {results[0]['peak_mb'] / results[1]['peak_mb']:.2f}")
    print(json.dumps(results))


if __name__ == "__main__":
    main()
