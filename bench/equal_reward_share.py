"""What the groups of equal rewards carry in an update that keeps them: their share of its gradient and time.

Under a token rule with a KL term (``archer``'s ``kl_low``, the default before the cost grid),
``train.optimizer.equal_reward_groups: keep`` or ``auto`` keeps the groups whose completions all earned the same reward. Their advantage is 0, so
their whole gradient is the KL term's, and it is zero where the policy is the reference (LoRA's
zero init): the share is measured at a trained adapter, on the batches of its last steps.

    python bench/equal_reward_share.py --adapter models/adapter [--params params.yaml] [--steps 4] [--json FILE]

Each measured step runs as the train stage's trainer runs it (``TrainerBuilder`` at the params'
train section, the adapter's weights loaded into the policy, the curriculum's batches of the last
``--steps`` steps): the rollouts, the reference pass, then each of the ``mu`` updates three times
over the same threshold and normaliser (the step's): on every row, on the rows of the groups of
equal rewards alone and on the others alone, each a batch of its own whole groups
(``PolicyPasses.loss_backward`` per micro-batch, as ``accumulate_gradients`` runs it). The loss
is a sum over tokens divided by the step's normaliser, so the two parts add up to the whole; the
printed ``residual`` (||g - g_eq - g_signal|| / ||g||) checks it. The whole gradient then takes the
optimizer step, so the second update starts where training's does (its old log-probs: the first
update's).

Figures per update, over the flattened LoRA gradient (the trainable parameters):

* ``rows_share``: the update's rows in groups of equal rewards (``zero_adv_update_frac``);
* ``norm_share``: ||g_eq|| / ||g||;
* ``projection_share``: <g_eq, g> / ||g||^2, the part of the whole gradient along itself that the
  equal-reward rows give (the other rows give 1 minus it);
* ``cosine``: cos(g_eq, g_signal), whether the KL rows push with or against the policy term;
* ``time_share``: the seconds of the equal-reward rows' forward and backward over those of both
  parts (each timed alone, micro-batched as the stage would batch that many rows).

These are shares of the gradient before the norm clip and AdamW (the clip scales both parts alike;
AdamW's per-coordinate scaling is not linear in the gradient, so no share of the parameter step is
claimed). A step whose rows all fall in one part reports the shares it can (``None`` otherwise).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))

from grpo.algorithm.loss import signal_groups  # noqa: E402
from grpo.config.params import load_params  # noqa: E402
from grpo.core.device import default_device  # noqa: E402
from grpo.core.jsonio import read_jsonl  # noqa: E402
from grpo.core.types import TrainBatch  # noqa: E402
from grpo.training.trainer_builder import TrainerBuilder  # noqa: E402


class AdapterBuilder(TrainerBuilder):
    """The train stage's builder with the policy's LoRA weights read from ``adapter``."""

    def __init__(self, params, device: str, adapter: Path):
        super().__init__(params, device)
        self.adapter = adapter

    def policy(self):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        model = super().policy()
        weights = self.adapter / "adapter_model.safetensors"
        if not weights.exists():
            raise SystemExit(f"equal_reward_share: error: {weights} not found (--adapter names a trained adapter's folder)")
        set_peft_model_state_dict(model, load_file(str(weights), device=str(self.device)))
        return model


def flat_grad(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The (P,) float32 concatenation of the parameters' gradients (zeros where none)."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).float().flatten() for p in params])


def part_gradient(trainer, batch: TrainBatch, normalizer: float, threshold) -> tuple[torch.Tensor, float, torch.Tensor]:
    """One update's backward over ``batch`` (whole groups), micro-batched as the stage does, at the
    given step-wide ``normalizer`` and ``threshold``: its (P,) gradient, its seconds and its (n, C)
    detached log-probs. The parameters' gradients are cleared before and after."""
    passes = trainer.passes
    for p in trainer.params:
        p.grad = None
    t0, logps = time.perf_counter(), []
    for sl in passes.slices(len(batch)):
        logps.append(passes.loss_backward(batch[sl], normalizer, threshold)[4])
    seconds = time.perf_counter() - t0
    grad = flat_grad(trainer.params)
    for p in trainer.params:
        p.grad = None
    return grad, seconds, torch.cat(logps)


def shares(whole: torch.Tensor, eq: torch.Tensor | None, signal: torch.Tensor | None) -> dict[str, float | None]:
    """The gradient figures of the module docstring from the (P,) gradients of the whole and its parts."""
    norm2 = float(whole.dot(whole))
    out: dict[str, float | None] = {"grad_norm": norm2 ** 0.5, "norm_share": None, "projection_share": None,
                                    "cosine": None, "residual": None}
    if norm2 == 0:
        return out
    parts = [g for g in (eq, signal) if g is not None]
    out["residual"] = float((whole - sum(parts)).norm()) / norm2 ** 0.5
    if eq is not None:
        out["norm_share"] = float(eq.norm()) / norm2 ** 0.5
        out["projection_share"] = float(eq.dot(whole)) / norm2
        if signal is not None and float(eq.norm()) > 0 and float(signal.norm()) > 0:
            out["cosine"] = float(torch.nn.functional.cosine_similarity(eq, signal, dim=0))
    elif signal is not None:
        out["norm_share"] = out["projection_share"] = 0.0
    return out


def measure_step(trainer) -> list[dict]:
    """One step's rollouts, then each of its ``mu`` updates measured in parts and applied whole."""
    passes, cfg = trainer.passes, trainer.cfg
    scored = trainer.collect()
    step_batch = TrainBatch.from_rollout(scored.rollout, scored.advantages, trainer.device)
    normalizer = passes.step_normalizer(step_batch.mask)
    batch = passes.fixed_logprobs(trainer.update_rows(step_batch, scored))  # (n, C): every row (they are kept)
    g, mine = cfg.rollouts.group_size, slice(scored.first_prompt, scored.first_prompt + len(scored.rows))
    equal = ~signal_groups(scored.step_rewards, g)[mine].repeat_interleave(g).to(batch.mask.device)  # (n,) whole groups
    eq_rows, signal_rows = equal.nonzero().squeeze(1), (~equal).nonzero().squeeze(1)
    rows = []
    for k in range(cfg.optimizer.mu):
        threshold = None
        if passes.rule.needs_statistic():
            threshold = passes.step_threshold(passes.no_grad_pass(batch, adapter=True)[0], batch.mask)
        whole, whole_s, logp = part_gradient(trainer, batch, normalizer, threshold)
        eq, eq_s, _ = part_gradient(trainer, batch[eq_rows], normalizer, threshold) if len(eq_rows) else (None, 0.0, None)
        sig, sig_s, _ = (part_gradient(trainer, batch[signal_rows], normalizer, threshold) if len(signal_rows)
                         else (None, 0.0, None))
        rows.append({"step": trainer.step + 1, "update": k + 1, "rows": len(batch), "equal_reward_rows": len(eq_rows),
                     "rows_share": len(eq_rows) / max(len(batch), 1), **shares(whole, eq, sig),
                     "seconds_whole": whole_s, "seconds_equal": eq_s, "seconds_signal": sig_s,
                     "time_share": eq_s / (eq_s + sig_s) if eq_s + sig_s > 0 else None})
        if batch.old_logp is None and cfg.optimizer.mu > 1:
            batch = replace(batch, old_logp=logp)  # the later updates' old policy: the sampling weights'
        offset = 0
        for p in trainer.params:  # the whole gradient takes the optimizer step, as in training
            p.grad = whole[offset:offset + p.numel()].view_as(p).to(p.dtype)
            offset += p.numel()
        trainer.updater.step()
    trainer.scheduler.step()
    trainer.step += 1
    return rows


def summary(rows: list[dict]) -> dict[str, float | None]:
    """The mean of each figure over the updates that have it."""
    keys = ("rows_share", "norm_share", "projection_share", "cosine", "time_share", "residual")
    return {k: (statistics.fmean(v) if (v := [r[k] for r in rows if r[k] is not None]) else None) for k in keys}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--adapter", required=True, help="a trained adapter's folder (the train stage's models/adapter)")
    ap.add_argument("--params", default="params.yaml", help="the params whose train section the adapter was trained at")
    ap.add_argument("--steps", type=int, default=4, help="steps measured: the curriculum's last ones")
    ap.add_argument("--json", help="write the rows and their means here")
    args = ap.parse_args(argv)
    params = load_params(args.params)
    cfg = params.train
    device = default_device()
    built = AdapterBuilder(params, device, Path(args.adapter)).build(read_jsonl(cfg.data_path))
    trainer = built.trainer
    if not trainer.keeps_equal_reward_groups():
        built.backend.close()
        print(f"equal_reward_share: error: {args.params} drops the groups of equal rewards from the update "
              f"(train.optimizer.equal_reward_groups {cfg.optimizer.equal_reward_groups}, rule {cfg.loss.entropy_rule}): "
              "nothing of theirs to measure", file=sys.stderr)
        return 2
    trainer.step = max(cfg.steps - args.steps, 0)
    print(f"equal_reward_share: rule {cfg.loss.entropy_rule}, mu {cfg.optimizer.mu}, equal_reward_groups "
          f"{cfg.optimizer.equal_reward_groups} (kept: {trainer.keeps_equal_reward_groups()}), steps "
          f"{trainer.step + 1}-{trainer.step + args.steps}, adapter {args.adapter}", flush=True)
    rows = []
    try:
        for _ in range(args.steps):
            for row in measure_step(trainer):
                rows.append(row)
                print("  " + " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in row.items()),
                      flush=True)
    finally:
        built.backend.close()
    means = summary(rows)
    print("mean: " + ", ".join(f"{k} {'-' if v is None else f'{v:.4f}'}" for k, v in means.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"adapter": args.adapter, "params": args.params, "rows": rows,
                                               "mean": means}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
