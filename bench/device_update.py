"""Seed 003's training update on a real card: CUDA's own memory counters at the preset's shapes.

The model is the preset's architecture with random weights (``grpo.memory.resolve_config``: the
architecture ``grpo.synthetic`` knows for ``model.name``; no download), saved and loaded back through
``grpo.lora_policy.load_policy`` as the train stage loads a base (bitsandbytes NF4, LoRA, gradient
checkpointing). The update is the one ``bench/cuda_memory.py`` traces on fake tensors, unchanged:
``PolicyPasses.fixed_logprobs`` then ``GRPOTrainer.update`` on random rollouts of
``prompts_per_step x group_size`` rows (``cuda_memory.make_trainer``), two steps; the figures are the
second's (AdamW's moments exist then). It prints and writes (``--json``) ``torch.cuda``'s
``max_memory_allocated`` / ``max_memory_reserved`` over that step, ``mem_get_info`` after it, and
``grpo check``'s training estimate for the same params (``grpo.memory.estimate``), with their ratio.

    python bench/device_update.py [--params presets/seed003.yaml] [--json FILE]
    python bench/device_update.py --dry-run    # on a CPU: the same code at toy sizes (no CUDA figures)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

SCHEMA = {
    "device": "str?: cuda, or cpu on --dry-run",
    "model": "str?: the architecture the weights were drawn for",
    "dtype": "str?: the compute dtype",
    "rows": "int?: completions in the step", "prompt_tokens": "int?: prompt length",
    "completion_tokens": "int?: completion length", "micro_batches": "int?: train.micro_batches",
    "entropy_rule": "str?: train.entropy_rule (its passes and LM-head rows with grad set the step's memory)",
    "resident_gib": "number?: CUDA allocated before the first step (weights, quantisation state, LoRA)",
    "peak_allocated_gib": "number?: torch.cuda.max_memory_allocated over the second step",
    "reserved_after_load_gib": "number?: CUDA reserved after grpo.lora_policy.load_policy (which gives its load's cache back)",
    "peak_reserved_gib": "number?: torch.cuda.max_memory_reserved over the second step",
    "free_gib": "number?: torch.cuda.mem_get_info's free after the second step",
    "total_gib": "number?: torch.cuda.mem_get_info's total",
    "estimate_gib": "number?: grpo check's training figure for these params (grpo.memory.estimate)",
    "ratio": "number?: peak allocated / estimate",
    "step_s": "number?: seconds of the second step's passes and update",
}
GiB = 2**30


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="presets/seed003.yaml", help="params file (a preset over params.yaml)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (the preset's cap)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a toy model, 8 new tokens: checks the script")
    ap.add_argument("--json", help="write the figures here")
    return ap.parse_args(argv)


def setup(args):
    """(params, model config, architecture name, device) for the run."""
    from grpo import memory
    from grpo.cli import resolve_params
    from grpo.synthetic import architecture_config

    res = resolve_params(args.params)
    p = res.params
    if args.dry_run:
        train = p.train.model_copy(update={"max_new_tokens": 8, "prompts_per_step": 2, "group_size": 2,
                                           "micro_batches": 2})
        return p.model_copy(update={"train": train}), architecture_config("toy"), "toy", "cpu"
    found = memory.resolve_config(p.model, res.root)
    if isinstance(found, str):
        raise SystemExit(f"{args.params}: {found}")
    config, source = found
    return p, config, source, "cuda"


def measure(args) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_memory import make_trainer

    from grpo import memory
    from grpo.base_model import load_tokenizer
    from grpo.device import compute_dtype
    from grpo.lora_policy import load_policy
    from grpo.metrics import PhaseTimer
    from grpo.synthetic import random_model_dir

    p, config, source, device = setup(args)
    dtype = compute_dtype(p.model.dtype, device)
    cuda = device == "cuda"
    out = {k: None for k in SCHEMA}
    t = p.train
    out.update(device=device, model=str(source), dtype=str(dtype).removeprefix("torch."),
               rows=t.prompts_per_step * t.group_size, prompt_tokens=args.prompt_tokens,
               completion_tokens=t.max_new_tokens, micro_batches=t.micro_batches, entropy_rule=t.entropy_rule)
    with tempfile.TemporaryDirectory() as tmp:
        base = random_model_dir(Path(tmp) / "base", config, dtype=dtype, device=device)
        model_cfg = p.model.model_copy(update={"path": str(base)})
        model = load_policy(model_cfg, p.lora, device)
        tok = load_tokenizer(base)
        if cuda:  # load_training_base gives its load's cache back: reserved here is what the step starts from
            torch.cuda.synchronize()
            out["reserved_after_load_gib"] = torch.cuda.memory_reserved() / GiB
            out["resident_gib"] = torch.cuda.memory_allocated() / GiB
        trainer, batch_of = make_trainer(model, tok, p, args.prompt_tokens, str(Path(tmp) / "run"), torch)
        for _step in (1, 2):  # the second step is measured (AdamW has moments then)
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            batch = batch_of()
            batch, entropy = trainer.passes.fixed_logprobs(batch)
            trainer.update(batch, entropy, trainer.passes.step_normalizer(batch.mask), batch.mask, PhaseTimer())
            del batch, entropy
            if cuda:
                torch.cuda.synchronize()
            out["step_s"] = time.perf_counter() - t0
        if cuda:
            free, total = torch.cuda.mem_get_info()
            out.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
                       peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB,
                       free_gib=free / GiB, total_gib=total / GiB)
        shapes = memory.model_shapes(config, source)
        est = memory.estimate(p, shapes, "cuda", args.prompt_tokens)
        out["estimate_gib"] = est.total("train") / GiB
        if out["peak_allocated_gib"] is not None:
            out["ratio"] = out["peak_allocated_gib"] / out["estimate_gib"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = measure(args)
    print(f"{args.params}: {out['model']} (random weights), {out['dtype']}, {out['rows']} rows x "
          f"({out['prompt_tokens']} + {out['completion_tokens']}) tokens, {out['micro_batches']} micro-batches, "
          f"entropy rule {out['entropy_rule']}")
    for key in ("reserved_after_load_gib", "resident_gib", "peak_allocated_gib", "peak_reserved_gib", "free_gib", "total_gib", "estimate_gib",
                "ratio", "step_s"):
        print(f"  {key:<20} {out[key]}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
