"""One interface for the optimizer side of the update: backward, step, and the state checkpoints keep.

The trainer computes each micro-batch's loss and hands it to ``Updater.backward``; after the
last micro-batch of an update it calls ``Updater.step``, which makes the gradient global (summed
over the data-parallel ranks), clips its norm to ``train.optimizer.max_grad_norm``, takes the AdamW step on
the LoRA parameters and clears the gradients. The trainer never knows which implementation runs:

* ``AdamWUpdater``: ``loss.backward()``; one flat all-reduce of the LoRA gradients over ranks
  (each rank's loss is already divided by the step-wide normaliser, so their sum is the gradient
  of one process holding the whole step), ``clip_grad_norm_``, ``torch.optim.AdamW``.
* ``grpo.training.zero.ZeroUpdater`` (``train.distribution.deepspeed_config`` names a DeepSpeed JSON): a DeepSpeed
  ZeRO-1/2 engine reduces, clips and steps.

``optimizer`` is the torch optimizer the LR schedule steps; ``state_dict`` / ``load_state_dict``
are what a checkpoint holds in place of the optimizer state (``grpo.training.checkpoint``).
"""

from __future__ import annotations

import math
import time
from typing import Protocol

import torch

from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist
from grpo.core.types import StepResult
from grpo.training.zero import ZeroUpdater


class Updater(Protocol):
    optimizer: torch.optim.Optimizer
    masks_rows: bool
    """Whether the update's rows without signal must stay, masked out, instead of being dropped:
    true where every rank must run the same backward passes (ZeRO reduces inside each one)."""
    restores_state: bool
    """Whether ``load_state_dict(state_dict())`` puts the whole optimizer state back (the trainer
    undoes a step's earlier inner updates with it): false where the state is partitioned over ranks."""

    def backward(self, loss: torch.Tensor) -> None:
        """Back-propagate one micro-batch's loss (gradients add up until ``step``)."""

    def step(self, skip: bool = False) -> StepResult:
        """Reduce over ranks, clip, step, clear the gradients; with ``skip`` (every rank passes the
        same), or a non-finite global gradient norm, clear the gradients without stepping."""

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class AdamWUpdater:
    """AdamW on ``params`` with the gradient summed over ``dist``'s ranks in one flat all-reduce."""

    masks_rows = False  # the all-reduce runs once per step: ranks may back-propagate different rows
    restores_state = True  # AdamW's moments are all in state_dict

    def __init__(self, params: list[torch.nn.Parameter], cfg: TrainConfig, dist: Dist):
        self.params, self.dist, self.max_grad_norm = params, dist, cfg.optimizer.max_grad_norm
        self.optimizer = torch.optim.AdamW(params, lr=cfg.optimizer.lr, weight_decay=cfg.optimizer.weight_decay)

    def backward(self, loss: torch.Tensor) -> None:
        if loss.requires_grad:  # a micro-batch whose tokens were all masked out has nothing to give
            loss.backward()

    def reduce_gradients(self) -> tuple[float, float]:
        """Sum the LoRA gradients over ranks before clipping; returns the seconds spent waiting
        for the slowest rank and in the all-reduce itself (both 0 with one process)."""
        if not self.dist.active:
            return 0.0, 0.0
        t0 = time.perf_counter()
        self.dist.barrier()
        t1 = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        summed = self.dist.all_reduce_many(grads, dtype=torch.float32)  # one flat fp32 all-reduce, (n_lora,)
        for p, g in zip(self.params, summed):
            p.grad = g.to(p.dtype).clone()
        return t1 - t0, time.perf_counter() - t1

    def step(self, skip: bool = False) -> StepResult:
        wait, allreduce = self.reduce_gradients()  # every rank reduces, skipped or not
        t0 = time.perf_counter()
        norm = float(torch.nn.utils.clip_grad_norm_(self.params, self.max_grad_norm))  # global: the same on every rank
        applied = not skip and math.isfinite(norm)
        if applied:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return StepResult(norm, wait, allreduce, time.perf_counter() - t0, applied)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


def make_updater(model: torch.nn.Module, params: list[torch.nn.Parameter], cfg: TrainConfig, dist: Dist) -> Updater:
    """DeepSpeed ZeRO when ``train.distribution.deepspeed_config`` names a JSON, else AdamW + all-reduce."""
    if cfg.distribution.deepspeed_config:
        return ZeroUpdater(model, params, cfg, dist)
    return AdamWUpdater(params, cfg, dist)
