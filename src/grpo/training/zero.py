"""DeepSpeed ZeRO for the trainer's update (``train.distribution.deepspeed_config``).

With a DeepSpeed JSON named, the LoRA update runs through a DeepSpeed engine instead of the
trainer's AdamW, hand all-reduce of the gradients and ``clip_grad_norm_``: ZeRO-2 reduce-scatters
the gradients during backward and each rank keeps the AdamW state of its share of the LoRA
parameters only, in CPU memory with ``offload_optimizer`` (``DeepSpeedCPUAdam``). Rollouts, the
loss, the entropy mask and checkpoints stay the trainer's.

Contract:

* ``ZeroUpdater(model, params, cfg, dist)`` (a ``grpo.training.updater.Updater``) builds the engine over the PEFT ``model`` with an
  optimizer over ``params`` (the trainable LoRA parameters). The JSON decides how the update is
  laid out (ZeRO stage 1 or 2, offload, bf16/fp16: DeepSpeed casts the whole model, so the policy
  must already compute in that dtype, ``model.dtype``); the trainer's params decide the update and
  replace what the JSON says (logged when it differs): the optimizer (AdamW, ``train.optimizer.lr``,
  ``train.optimizer.weight_decay``), ``gradient_clipping`` (``train.optimizer.max_grad_norm``), and the accumulation:
  the trainer calls backward once per micro-batch and steps once per update, so
  ``managed_gradient_accumulation`` is false (every ``step()`` is the accumulation boundary),
  ``gradient_accumulation_steps`` is ``train.passes.micro_batches`` and ``train_micro_batch_size_per_gpu``
  the completions of one micro-batch on one rank (both only count samples then; the JSON's
  ``train_batch_size`` is dropped). A JSON ``scheduler`` is refused: the trainer's LR schedule
  steps ``optimizer``.
* ``backward(loss)``: one micro-batch's backward. DeepSpeed averages gradients over ranks, and each
  rank's loss is already divided by the step-wide normaliser (their sum is the step's gradient),
  so the loss is multiplied by the world size. Every rank calls it equally often (ZeRO-2 reduces
  inside each backward), also for a loss without grad.
* ``step() -> StepResult``: finish the reduction, clip, AdamW step, zero the gradients; reports the
  global gradient norm before clipping (the trainer's ``grad_norm``).
* ``optimizer``: the torch optimizer that holds this rank's partition (the LR scheduler's target).
* ``state_dict()`` / ``load_state_dict()``: what a checkpoint holds in place of the optimizer state.
  The AdamW moments are partitioned over ranks (and offloaded) while rank 0 alone writes
  checkpoints, so they are not saved: a resumed run restarts AdamW's moments and step count (logged)
  from the checkpoint's LoRA weights, learning rates (the groups' ``lr``), LR schedule, RNG states
  and step. ``load_state_dict`` runs after the adapter is loaded and copies it into ZeRO's fp32
  master weights.
* One process: a one-rank gloo group is created when none exists (DeepSpeed needs a process group).
  On CPUs DeepSpeed's communication backend is gloo (ccl only with oneccl_bindings_for_pytorch).
* First use JIT-compiles DeepSpeed's C++ ops with the system compiler and ninja (``cpu_adam`` for
  the offload; ``deepspeed_shm_comm`` on CPUs), then cached in ``~/.cache/torch_extensions``
  (``TORCH_EXTENSIONS_DIR``); the docs' scaling-out page has the time it takes.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from pathlib import Path

import torch

from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist
from grpo.core.errors import ParamsError, StageStop
from grpo.core.types import StepResult

log = logging.getLogger(__name__)


def engine_config(cfg: TrainConfig, world_size: int) -> dict:
    """The DeepSpeed config: the JSON at ``cfg.distribution.deepspeed_config`` with the trainer's optimizer,
    clipping and accumulation put over it (see the module docstring)."""
    path = Path(cfg.distribution.deepspeed_config)
    try:
        ds = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise ParamsError(f"train.distribution.deepspeed_config: cannot read {path} as JSON ({err})") from None
    stage = ds.get("zero_optimization", {}).get("stage", 0)
    if stage not in (1, 2):
        raise ParamsError(f"train.distribution.deepspeed_config: {path}: zero_optimization.stage {stage}; the trainer runs "
                         "ZeRO stage 1 or 2 (stage 3 partitions the weights its own forward passes read)")
    if "scheduler" in ds:
        raise ParamsError(f"train.distribution.deepspeed_config: {path}: remove 'scheduler'; train.optimizer.lr_schedule and "
                         "train.optimizer.warmup_steps set the learning rate")
    rows = math.ceil(cfg.rollouts.prompts_per_step // world_size * cfg.rollouts.group_size / cfg.passes.micro_batches)
    ours = {
        "optimizer": {"type": "AdamW", "params": {"lr": cfg.optimizer.lr, "weight_decay": cfg.optimizer.weight_decay,
                                                  "betas": [0.9, 0.999], "eps": 1e-8}},
        "gradient_clipping": cfg.optimizer.max_grad_norm,
        "gradient_accumulation_steps": cfg.passes.micro_batches,
        "train_micro_batch_size_per_gpu": rows,
        "managed_gradient_accumulation": False,
    }
    for key, value in ours.items():
        if key in ds and ds[key] != value:
            log.warning("%s: %s %s replaced by %s (the trainer's params decide the update; grpo.training.zero)",
                        path, key, json.dumps(ds[key]), json.dumps(value))
    ds.pop("train_batch_size", None)
    return {**ds, **ours}


def _ensure_process_group(dist: Dist) -> None:
    """DeepSpeed needs torch.distributed and ``LOCAL_RANK``: a one-rank gloo group for a single
    process (the launcher's group is joined by ``grpo.core.distributed.init_from_env`` otherwise)."""
    import torch.distributed as tdist

    os.environ.setdefault("LOCAL_RANK", str(dist.local_rank))  # the launchers set it; one process: 0

    if not tdist.is_initialized():
        if dist.active:
            raise RuntimeError("train.distribution.deepspeed_config: the process group of the data-parallel ranks is not up")
        tdist.init_process_group("gloo", store=tdist.HashStore(), rank=0, world_size=1)


def _check_precision(model: torch.nn.Module, config: dict, path: str) -> None:
    """DeepSpeed's bf16/fp16 casts every floating-point parameter of the model, the frozen base's
    too: refuse unless the policy already computes in that dtype (``model.dtype``)."""
    for key, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16)):
        if not config.get(key, {}).get("enabled", False):
            continue
        name = str(dtype).removeprefix("torch.")
        other = {str(p.dtype).removeprefix("torch.") for p in model.parameters()
                 if p.is_floating_point() and not p.requires_grad} - {name}
        if other:
            raise ParamsError(f"train.distribution.deepspeed_config: {path}: {key}.enabled casts the policy to {name}, but it "
                              f"computes in {', '.join(sorted(other))}; set model.dtype: {name} (or disable {key} "
                              "in the JSON)")


class ZeroUpdater:
    """The optimizer step of the LoRA ``params`` through a DeepSpeed engine (see the module docstring)."""

    masks_rows = True  # ZeRO reduces inside every backward: every rank runs the same passes
    restores_state = False  # state_dict holds the learning rates only: the moments are partitioned

    def __init__(self, model: torch.nn.Module, params: list[torch.nn.Parameter], cfg: TrainConfig, dist: Dist):
        import deepspeed

        _ensure_process_group(dist)
        config = engine_config(cfg, dist.world_size)
        _check_precision(model, config, cfg.distribution.deepspeed_config)
        self.engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=params, config=config)
        self.params, self.world_size = params, dist.world_size
        self.optimizer = self.engine.optimizer.optimizer  # this rank's partition (DeepSpeedCPUAdam when offloaded)
        log.info("DeepSpeed ZeRO stage %d over %d LoRA tensors, optimizer %s, %d rank(s), from %s",
                 config["zero_optimization"]["stage"], len(params), type(self.optimizer).__name__,
                 dist.world_size, cfg.distribution.deepspeed_config)

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of one micro-batch's loss (scaled to DeepSpeed's averaging over ranks)."""
        if not loss.requires_grad:  # nothing to back-propagate here, but every rank reduces in every backward
            loss = loss + sum(p.sum() * 0 for p in self.params)
        self.engine.backward(loss * self.world_size, scale_wrt_gas=False)

    def step(self, skip: bool = False) -> StepResult:
        """Reduce, clip, AdamW step, zero grads; the gradient norm before clipping. ``skip`` (a
        non-finite loss or log-prob on some rank) stops the stage: a DeepSpeed engine has no step
        that leaves its partitioned state untouched (its own fp16 loss scaling skips overflowing
        steps; bf16 and fp32 have none)."""
        if skip:
            raise StageStop("train: a non-finite loss or log-prob under DeepSpeed (train.distribution.deepspeed_config); "
                            "DeepSpeed cannot skip the update: resume from the last checkpoint in fp32 or bf16")
        t0 = time.perf_counter()
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        return StepResult(float(norm) if norm is not None else 0.0, optimizer_s=time.perf_counter() - t0)

    def state_dict(self) -> dict:
        """Stands in for the optimizer state in checkpoints: the learning rates of the parameter
        groups, nothing of the partitioned AdamW state."""
        groups = [{k: v for k, v in g.items() if k in ("lr", "initial_lr")} for g in self.optimizer.param_groups]
        return {"state": {}, "param_groups": groups, "deepspeed": "AdamW moments not saved (partitioned over ranks)"}

    def load_state_dict(self, state: dict) -> None:
        """On resume, after the adapter is loaded: the learning rates are restored, AdamW's moments
        restart, and ZeRO's fp32 master weights take the loaded LoRA weights."""
        for group, saved in zip(self.optimizer.param_groups, state["param_groups"], strict=True):
            group.update({k: v for k, v in saved.items() if k in ("lr", "initial_lr")})
        log.warning("DeepSpeed: resuming with fresh AdamW moments (the partitioned optimizer state is not "
                    "checkpointed); the LoRA weights, learning rate, RNG states and step are restored")
        self.engine.optimizer.refresh_fp32_params()
