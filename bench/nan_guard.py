"""The non-finite guard with a real overflow: a LoRA weight at 1e38 in a bf16 update.

A small random Qwen2 (``grpo.tools.synthetic``'s ``toy``) in bitsandbytes NF4 with bf16 compute and
LoRA, trained by ``GRPOTrainer.train_step`` on the card (or the CPU where there is none). Step 1 is
clean, so AdamW has moments. From step 2 on, between the rollouts and the update (the rollouts
are sampled with clean weights: a NaN in sampling is another failure than the one measured), every
``lora_B`` weight of the first LoRA layer is set to ``--poison`` (1e38: finite in bf16, whose
largest value is about 3.4e38, so the overflow happens in the update's own arithmetic), and the
clean values come back before the next rollouts. For each poisoned step it records whether the row
says ``update_skipped``, whether every LoRA weight and AdamW's moments and step count are as they
were before the update, and the learning rate before and after; the guard
(``trainer.NonFiniteGuard``, ``train.guards.max_nonfinite_steps``) must stop training with one line at
the limit.

    python bench/nan_guard.py [--device cuda|cpu] [--limit 2] [--json FILE]

Exit 0 when every poisoned step was skipped with its state unchanged and the stop came at the
limit; 1 otherwise (the JSON says what held).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

SCHEMA = {
    "device": "str?: where it ran", "dtype": "str?: the compute dtype",
    "poison": "number?: the value written into lora_B", "limit": "int?: train.guards.max_nonfinite_steps",
    "clean_step_applied": "bool?: step 1 (clean) updated the weights",
    "skipped": "list[str]: per poisoned step: step N: skipped=..., weights unchanged=..., adam unchanged=..., lr a -> b",
    "all_skipped_unchanged": "bool?: every poisoned step skipped, weights and AdamW state unchanged",
    "lr_advanced_on_skip": "bool?: the LR schedule moved on a skipped step",
    "stop": "str?: the guard's line (StageStop)", "stopped_at_limit": "bool?: the stop came at the limit-th skipped step",
    "ok": "bool?: all of the above held",
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", help="cuda or cpu (default: cuda where there is one)")
    ap.add_argument("--poison", type=float, default=1e38)
    ap.add_argument("--limit", type=int, default=2, help="train.guards.max_nonfinite_steps")
    ap.add_argument("--json", help="write the result here")
    return ap.parse_args(argv)


def varied_reward(completions, answers):
    """A reward that differs within a group whatever a random model writes (so the update is not empty)."""
    return [float(sum(map(ord, c)) % 7) for c in completions]


def state_of(trainer):
    """(LoRA weights, AdamW state) copied."""
    weights = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    adam = [{k: v.clone() if hasattr(v, "clone") else v for k, v in s.items()}
            for s in trainer.updater.optimizer.state.values()]
    return weights, adam


def same(a, b) -> tuple[bool, bool]:
    import torch

    weights = a[0].keys() == b[0].keys() and all(torch.equal(a[0][n], b[0][n]) for n in a[0])
    adam = len(a[1]) == len(b[1]) and all(
        x.keys() == y.keys() and all(torch.equal(torch.as_tensor(x[k]), torch.as_tensor(y[k])) for k in x)
        for x, y in zip(a[1], b[1]))
    return weights, adam


def build(args, tmp: Path):
    import torch

    from grpo.algorithm.rewards import REWARDS
    from grpo.config.params import AllParams
    from grpo.tools.synthetic import architecture_config, random_model_dir
    from grpo.training.trainer_builder import build_trainer, depart, departure_line

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    REWARDS["varied"] = varied_reward
    base = random_model_dir(tmp / "base", architecture_config("toy"), dtype=torch.bfloat16, device=device)
    changes = {"model.path": str(base), "model.dtype": "bfloat16", "model.gradient_checkpointing": True,
               "lora.rank": 8, "lora.alpha": 16.0, "train.output_dir": str(tmp / "run"), "train.steps": 2 + args.limit,
               "train.rollouts.prompts_per_step": 2, "train.rollouts.group_size": 4, "train.rollouts.max_new_tokens": 8, "train.checkpoints.every": 0,
               "train.checkpoints.eval_every": 0, "train.rewards": {"varied": 1.0}, "train.truncated": "score",
               "train.optimizer.warmup_steps": 0, "train.optimizer.lr": 1e-2, "train.optimizer.lr_schedule": "cosine",
               "train.guards.max_nonfinite_steps": args.limit, "train.rollouts.backend": "transformers"}
    print(f"the default params but {departure_line({k: v for k, v in changes.items() if 'path' not in k and 'dir' not in k})}",
          file=sys.stderr)
    problems = [{"id": f"p{i}", "question": f"What is {i} + {i + 1}?", "answer": str(2 * i + 1), "solution": ""}
                for i in range(8)]
    return build_trainer(depart(AllParams(), changes), device, problems=problems).trainer, device


def run(args) -> dict:
    import torch

    from grpo.core.errors import StageStop

    out = {k: None for k in SCHEMA}
    out.update(poison=args.poison, limit=args.limit, skipped=[], dtype="bfloat16")
    with tempfile.TemporaryDirectory() as tmp:
        trainer, device = build(args, Path(tmp))
        out["device"] = device
        before = state_of(trainer)
        trainer.guard.check(trainer.train_step(), lambda: None)
        out["clean_step_applied"] = not same(before, state_of(trainer))[0]
        target = next(m for n, m in trainer.model.named_modules() if n.endswith("lora_B.default"))
        clean = target.weight.detach().clone()
        collect, seen = trainer.collect, {}

        def poisoned_collect():
            with torch.no_grad():
                target.weight.copy_(clean)
            scored = collect()  # rollouts from clean weights
            with torch.no_grad():
                target.weight.fill_(args.poison)
            seen["state"] = state_of(trainer)
            return scored

        trainer.collect = poisoned_collect
        rows_ok = []
        try:
            for _ in range(args.limit + 1):
                lr_before = trainer.scheduler.get_last_lr()[0]
                row = trainer.train_step()
                weights_same, adam_same = same(seen["state"], state_of(trainer))
                lr_after = trainer.scheduler.get_last_lr()[0]
                skipped = bool(row.get("update_skipped"))
                rows_ok.append(skipped and weights_same and adam_same)
                out["lr_advanced_on_skip"] = bool(out["lr_advanced_on_skip"]) or (skipped and lr_after != lr_before)
                out["skipped"].append(f"step {row['step']}: skipped={skipped}, weights unchanged={weights_same}, "
                                      f"adam unchanged={adam_same}, lr {lr_before:.3g} -> {lr_after:.3g}")
                trainer.guard.check(row, lambda: None)
        except StageStop as stop:
            out["stop"] = str(stop)
        out["all_skipped_unchanged"] = bool(rows_ok) and all(rows_ok)
        out["stopped_at_limit"] = out["stop"] is not None and len(rows_ok) == args.limit
        out["ok"] = bool(out["clean_step_applied"] and out["all_skipped_unchanged"] and out["stopped_at_limit"])
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    out = run(args)
    print(f"nan guard on {out['device']} in {out['dtype']}, lora_B = {args.poison:g} from step 2, limit {args.limit}")
    print(f"  clean step applied: {out['clean_step_applied']}")
    for line in out["skipped"]:
        print(f"  {line}")
    print(f"  stop: {out['stop']}")
    print(f"  ok: {out['ok']}")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
