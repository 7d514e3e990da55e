"""The GRPO loop: each step in three phases, validation, checkpoints and resume.

One optimizer step (``GRPOTrainer.train_step``):

1. **rollouts** (``collect``, ``grpo.training.rollout_phase``): the next ``prompts_per_step`` problems in the
   curriculum's order (the data position wraps around at the end); G completions per prompt from
   the rollout backend, synced to the policy first (``grpo.rollout.rollout_backends``); rewards and group-relative
   advantages -> ``StepRollouts``; generation state is dropped before training;
2. **the update's rows** (``update_rows``): the step's loss normaliser is taken over every
   completion, then the groups whose rewards are all equal are dropped (their advantages are zero,
   so without a KL term their gradient is exactly zero: DAPO's filter, arXiv 2503.14476, without its
   re-sampling); **the reference pass** (``grpo.training.passes.PolicyPasses.fixed_logprobs``, no grad):
   with ``beta > 0`` or a token-entropy rule with a KL term (``PolicyPasses.needs_reference``) the
   reference log-probs (the adapter disabled) -> the ``TrainBatch``'s ``ref_logp``;
3. **update** (``update``): ``mu`` times the gradients of the step's rows, micro-batch by
   micro-batch, under the step's entropy mask (``PolicyPasses.accumulate_gradients``), then the
   updater's step (``grpo.training.updater``: all-reduce, clip, AdamW; or DeepSpeed ZeRO) -> ``UpdateStats``;
   with ``mu > 1`` the first update's detached log-probs (taken at the sampling weights) are the
   later updates' ``old_logp``;

Dropping the uniform groups changes the update in one place only: the entropy threshold is the
quantile over the tokens of the groups with signal, not over every token of the step (the tokens
of a uniform group get no gradient whatever the mask says). It is skipped when the loss has a KL
term (``beta > 0``, or the token-entropy rule's: it has a gradient at zero advantage); under
DeepSpeed (every rank must run the same number of backward passes) those rows stay with their
tokens masked out: the same update, no time saved.
A step without any group with signal updates all its rows as before.

then the step's row (``grpo.training.metrics``: every statistic declared once with its reduction).

Data parallel (``grpo.core.distributed.Dist``, ``world_size`` W > 1): rank r takes the r-th contiguous
``prompts_per_step / W`` prompts of the step (whole groups) and samples, scores and back-propagates
only those. Reduced over ranks, so that W processes make the update of one process with all
prompts: the rewards (all-gathered), the loss normaliser, the entropy threshold (the quantile over
every rank's gathered entropies: exact), the LoRA gradients (summed before clipping) and the
logged statistics. Rank 0 alone writes the run directory (``grpo.training.run_dir``); on resume rank 0
reads the checkpoint (verifying it and moving damaged ones aside) and sends it to every rank.

Checkpoints (every ``checkpoint_every`` steps, ``grpo.training.checkpoint``) hold the adapter, optimizer,
scheduler, RNG states, step and data position; ``train`` resumes from the newest intact one and
truncates the step log and samples to it, so the resumed run repeats and skips nothing.
"""

from __future__ import annotations

import copy
import gc
import logging
import math
import resource
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import torch

from grpo.algorithm.curriculum import batch_indices, num_stages_of, stage_of_step, stages_for
from grpo.algorithm.entropy import TokenRule
from grpo.algorithm.loss import LossSettings, signal_groups
from grpo.algorithm.rewards import REWARDS
from grpo.algorithm.stats import clustered_interval
from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist
from grpo.core.errors import StageStop
from grpo.core.types import Rollout, StepRollouts, TrainBatch, UpdateStats
from grpo.data.answers import cluster_key
from grpo.data.sources import build_prompt
from grpo.rollout.rollout_backends import RolloutBackend, TransformersBackend
from grpo.training import checkpoint, metrics, rollout_phase
from grpo.training.passes import PolicyPasses
from grpo.training.run_dir import RunDir
from grpo.training.updater import make_updater

log = logging.getLogger(__name__)

StepCallback = Callable[[dict], None]


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the peak lr at scheduler step s: linear warm-up, then the chosen decay."""

    def fn(s: int) -> float:
        if s < cfg.optimizer.warmup_steps:
            return (s + 1) / (cfg.optimizer.warmup_steps + 1)
        if cfg.optimizer.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (s - cfg.optimizer.warmup_steps) / max(1, cfg.steps - cfg.optimizer.warmup_steps))
        if cfg.optimizer.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory, or the process's peak resident set size on the CPU (MB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def validation_interval(outcomes: list[tuple[bool, str]]) -> dict[str, float]:
    """The validation accuracy's 95% interval that counts a problem once, from every validation
    problem's ``(correct, cluster key)`` (``grpo.data.answers.cluster_key``: its operand multiset), as
    the evaluations' (``grpo.algorithm.stats.clustered_interval``): ``val_ci_low``, ``val_ci_high``,
    ``val_clusters``, ``val_effective_n``; empty without problems."""
    if not outcomes:
        return {}
    ci = clustered_interval([ok for ok, _ in outcomes], [key for _, key in outcomes])
    return {"val_ci_low": ci.low, "val_ci_high": ci.high, "val_clusters": ci.clusters,
            "val_effective_n": ci.effective_n}


class NonFiniteGuard:
    """Counts the steps in a row whose update was skipped for a non-finite loss, log-prob or
    gradient norm (``update_skipped`` in the row); ``limit`` of them stop training with one line
    naming the steps and the last checkpoint (a skipped step writes none)."""

    def __init__(self, limit: int):
        self.limit, self.count = limit, 0

    def check(self, row: dict, last_checkpoint: Callable[[], object]) -> None:
        if not row.get("update_skipped"):
            self.count = 0
            return
        self.count += 1
        step = row["step"]
        log.warning("step %d: a non-finite loss, log-prob or gradient norm; the update was not applied "
                    "(%d in a row)", step, self.count)
        if self.count >= self.limit:
            raise StageStop(f"train: steps {step - self.count + 1}-{step}: {self.count} updates in a row not applied "
                            f"(a non-finite loss, log-prob or gradient norm; train.guards.max_nonfinite_steps {self.limit}); "
                            f"the last good checkpoint: {last_checkpoint() or 'none (train.checkpoints.every)'}; "
                            "fp16 overflows: try model.dtype float32 or bf16")


class EngineGapGuard:
    """Watches the engine's log-prob gap to the policy (``logp_mismatch_mean`` in the row, in
    nats per completion token): a step above ``bound`` logs a warning, ``limit`` of them in a row
    stop training with one line. A gap that large means the engine samples from another model than
    the one trained (a sync that did not land, an adapter lost in a wake-up), so the importance
    weights would be correcting noise."""

    def __init__(self, bound: float, limit: int):
        self.bound, self.limit, self.count = bound, limit, 0

    def check(self, row: dict) -> None:
        gap = row.get("logp_mismatch_mean")
        if gap is None or gap <= self.bound:
            self.count = 0
            return
        self.count += 1
        step = row["step"]
        log.warning("step %d: the engine's log-probs are %.3g nats/token from the policy's (train.guards.max_logp_gap %g; "
                    "%d in a row): its samples come from another model than the one trained", step, gap, self.bound,
                    self.count)
        if self.count >= self.limit:
            raise StageStop(f"train: steps {step - self.count + 1}-{step}: the engine's log-probs {gap:.3g} nats/token "
                            f"from the policy's, above train.guards.max_logp_gap {self.bound:g} {self.count} steps in a row: "
                            "the engine does not hold the policy (a sync or wake-up lost it); "
                            "try the other train.rollouts.engine_weights form, or report it with bench/device_check.py's file")


def progress_postfix(history: list[dict]) -> dict[str, str]:
    """The training bar's figures: the last step's reward and rollout accuracy, and the last
    validation accuracy measured so far ("-" before the first)."""
    last = history[-1]
    val = next((r["val_accuracy"] for r in reversed(history) if "val_accuracy" in r), None)
    cells = {"reward": last["reward_mean"], "acc": last["rollout_accuracy"], "val": val}
    return {k: "-" if v is None else f"{v:.3f}" for k, v in cells.items()}


@dataclass(frozen=True)
class TrainerParts:
    """What a trainer runs besides the policy and the params, each built once by the trainer
    builder (``grpo.training.trainer_builder.TrainerBuilder``, the train stage's) and handed down:
    the trainer builds none of them."""

    backend: RolloutBackend | None
    """Samples the rollouts; ``None``: the decode loop on the policy (``TransformersBackend``)."""
    rule: TokenRule
    """The token-entropy rule (``grpo.algorithm.entropy.build_token_rule`` of ``train.loss``)."""
    loss: LossSettings
    """The loss's fixed settings (``grpo.algorithm.loss.build_loss`` of ``train.loss``)."""


class GRPOTrainer:
    """Composes the phases of a step into optimizer steps over ``problems`` (module docstring),
    with the rollout backend, token rule and loss of ``parts``."""

    def __init__(self, model, tokenizer, cfg: TrainConfig, problems: list[dict], *,
                 parts: TrainerParts, callbacks: list[StepCallback] | None = None,
                 val_problems: list[dict] | None = None, dist: Dist | None = None):
        self.model, self.tokenizer, self.cfg, self.problems = model, tokenizer, cfg, problems
        self.dist = dist or Dist()  # one process unless given
        cfg.check_split(self.dist.world_size)  # fails early unless the prompts split evenly
        self.stages = stages_for(cfg.order, len(problems), num_stages_of(cfg), cfg.seed)
        self.device = next(model.parameters()).device
        # the decode loop on the policy (its 4-bit layers dequantised once per call where that fits)
        self.backend = parts.backend or TransformersBackend(model, tokenizer)
        self.callbacks = callbacks or []
        self.val_problems = val_problems or []
        self._synced_step: int | None = None  # the step whose weights the backend's engine holds
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.updater = make_updater(model, self.params, cfg, self.dist)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.updater.optimizer, lr_lambda(cfg))
        self.passes = PolicyPasses(model, cfg, self.dist, self.updater, parts.rule, parts.loss)
        self.run = RunDir(cfg.output_dir, cfg.checkpoints.keep_best)
        self.step = 0
        self.guard = NonFiniteGuard(cfg.guards.max_nonfinite_steps)
        self.gap_guard = EngineGapGuard(cfg.guards.max_logp_gap, cfg.guards.max_logp_gap_steps)
        self.history: list[dict] = []
        self.last_samples: list[dict] = []  # the last step's completions, every rank's

    def batch_rows(self, step: int) -> list[dict]:
        """Problems of 0-based ``step`` (see ``grpo.algorithm.curriculum.batch_indices``)."""
        return [self.problems[i] for i in batch_indices(self.stages, step, self.cfg.steps, self.cfg.rollouts.prompts_per_step)]

    # ------------------------------------------------------------------ phase 1: rollouts
    def sync_backend(self) -> None:
        """Bring the backend to the policy's current weights, once per step (the decode loop
        samples the policy itself: a no-op there)."""
        if self._synced_step != self.step:
            self.backend.sync(self.model)
            self._synced_step = self.step

    def rollout(self, prompts: list[str], first_prompt: int = 0) -> Rollout:
        """G completions of each prompt from the synced backend (``grpo.training.rollout_phase.sample``), then the
        backend sleeps and generation memory is dropped for the update."""
        self.sync_backend()
        rollout = rollout_phase.sample(self.backend, prompts, self.cfg, self.step, first_prompt, self.tokenizer.pad_token_id)
        self.backend.sleep()
        if self.cfg.rollouts.release_generation_memory:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return rollout

    def collect(self) -> StepRollouts:
        """Phase 1: this rank's prompts of the step, their completions, rewards and advantages."""
        mine = self.dist.shard(self.cfg.rollouts.prompts_per_step)  # this rank's prompts (all for one process)
        rows = self.batch_rows(self.step)[mine]
        prompts = [build_prompt(self.tokenizer, r["question"], self.cfg.system_prompt) for r in rows]
        rollout = self.rollout(prompts, first_prompt=mine.start)
        return rollout_phase.score(rows, mine.start, rollout, self.cfg, self.dist, self.device)

    # ------------------------------------------------------------------ phase 2: the update's rows
    def keeps_equal_reward_groups(self) -> bool:
        """Whether the update keeps the groups of equal rewards (``train.optimizer.equal_reward_groups``:
        ``keep``; ``auto`` where the loss has a KL term, whose gradient those rows carry)."""
        how = self.cfg.optimizer.equal_reward_groups
        return how == "keep" or (how == "auto" and self.passes.needs_reference())

    def update_rows(self, batch: TrainBatch, scored: StepRollouts) -> TrainBatch:
        """This rank's rows of ``batch`` in the groups with signal (see the module docstring).
        Under DeepSpeed, where every rank must run the same backward passes, the other rows stay
        with every token masked out (the same update, no time saved); otherwise they are dropped,
        and a rank without a group with signal while another rank has one keeps its first group,
        masked out: it adds nothing, and every rank still runs one update."""
        g = self.cfg.rollouts.group_size
        if self.keeps_equal_reward_groups():
            return batch
        signal = signal_groups(scored.step_rewards, g)  # (P_step,) bool
        if not signal.any():
            return batch
        mine = signal[scored.first_prompt : scored.first_prompt + len(scored.rows)].to(batch.mask.device)  # (p,)
        rows = mine.repeat_interleave(g)  # (n,) bool
        if self.updater.masks_rows or not mine.any():
            kept = batch[:] if self.updater.masks_rows else batch[:g]
            return replace(kept, mask=kept.mask * rows[: len(kept), None])  # (n, C), zero outside the groups with signal
        return batch[rows.nonzero().squeeze(1)]  # (k,) rows

    # ------------------------------------------------------------------ phase 3: update
    def update(self, batch: TrainBatch, normalizer: float, step_mask: torch.Tensor,
               timer: metrics.PhaseTimer) -> UpdateStats:
        """``mu`` optimizer steps on ``batch`` (the update's rows; ``normalizer``: the whole step's
        loss normaliser; ``step_mask``: the (N, C) mask of all this rank's completions, for the
        counts), then one step of the LR schedule; the optimizer's times go to ``timer``. The first
        update runs at the sampling weights: its detached log-probs become ``old_logp`` of the
        others (where ``batch`` has none), the values a no-grad pass would give.

        All or nothing: when an inner update is not applied (non-finite), the step's earlier inner
        updates are undone too (LoRA weights and optimizer state as before the step; under
        DeepSpeed, whose partitioned state is not copied here, they stand), and the LR schedule
        does not advance, as for a step whose only update was skipped."""
        self.model.train()
        updates, applied = [], True
        before = self.update_state() if self.cfg.optimizer.mu > 1 and self.updater.restores_state else None
        for _ in range(self.cfg.optimizer.mu):
            sums, _kept, logp = self.passes.accumulate_gradients(batch, normalizer)
            if batch.old_logp is None and self.cfg.optimizer.mu > 1:
                batch = replace(batch, old_logp=logp)  # (n, C): the sampling policy's, before its optimizer step
            updates.append(sums)
            result = self.updater.step(skip=not self.finite_everywhere(sums))
            applied = applied and result.applied
            timer.add("time_optimizer_s", result.optimizer_s)
            timer.add("time_wait_s", result.wait_s)
            timer.add("time_allreduce_s", result.allreduce_s)
            if not result.applied:
                break  # the rest of the step would repeat the same update
        if applied:
            self.scheduler.step()
        elif before is not None and len(updates) > 1:
            self.restore_update_state(before)
            log.warning("step %d: inner update %d of mu %d was not applied: the %d before it are undone", self.step + 1,
                        len(updates), self.cfg.optimizer.mu, len(updates) - 1)
        counts = {"n_valid": float(batch.mask.sum()), "n_rows": float((batch.mask.sum(1) > 0).sum()),
                  "n_valid_step": float(step_mask.sum()), "n_rows_step": float(step_mask.shape[0])}
        return UpdateStats({**metrics.over_mu(updates), **counts}, result.grad_norm, applied=applied)

    def update_state(self) -> tuple[list[torch.Tensor], dict]:
        """A copy of what an update changes: the trainable weights and the optimizer's state."""
        return [p.detach().clone() for p in self.params], copy.deepcopy(self.updater.state_dict())

    def restore_update_state(self, state: tuple[list[torch.Tensor], dict]) -> None:
        weights, optimizer = state
        with torch.no_grad():
            for p, w in zip(self.params, weights):
                p.copy_(w)
        self.updater.load_state_dict(optimizer)

    def finite_everywhere(self, sums: metrics.Sums) -> bool:
        """Whether every rank's update statistics (loss, log-prob gap, entropy, ...) are finite: one
        all-reduce, so that every rank skips or steps alike."""
        bad = float(not all(math.isfinite(v) for v in sums.values.values()))
        return not self.dist.all_reduce(torch.tensor([bad], device=self.device), "max").item()

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        """Run one optimizer step (``self.step`` -> ``self.step + 1``) and return its row (the
        whole step's, the same on every rank up to the per-rank waiting times)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        stage = stage_of_step(self.step, self.cfg.steps, len(self.stages))  # the stage batch_rows draws from
        timer = metrics.PhaseTimer()
        with timer.phase("step_time_s"):
            with timer.phase("time_generate_s"):
                scored = self.collect()
            with timer.phase("time_logprob_s"):
                step_batch = TrainBatch.from_rollout(scored.rollout, scored.advantages, self.device)
                normalizer = self.passes.step_normalizer(step_batch.mask)  # over every completion of the step
                batch = self.passes.fixed_logprobs(self.update_rows(step_batch, scored))
            lr = self.scheduler.get_last_lr()[0]
            with timer.phase("time_update_s"):
                stats = self.update(batch, normalizer, step_batch.mask, timer)
        self.step += 1
        self.last_samples = [s for part in self.dist.all_gather_object(scored.samples(self.step)) for s in part]
        timer.add("peak_mem_mb", peak_memory_mb(self.device))
        if self.device.type == "cuda":
            timer.add("peak_reserved_mb", torch.cuda.max_memory_reserved(self.device) / 2**20)
        row = {"step": self.step, "stage": stage,
               **metrics.reward_stats(scored.step_rewards, scored.step_reward_parts, self.cfg.rollouts.group_size),
               **metrics.update_row(self.dist, stats.sums, timer.times, self.device),
               "grad_norm": stats.grad_norm, "lr": lr}
        if not stats.applied:  # non-finite values are logged as null (JSON has no NaN)
            row = {k: None if isinstance(v, float) and not math.isfinite(v) else v for k, v in row.items()}
            row["update_skipped"] = 1
        return row

    # ------------------------------------------------------------------ validation
    def validate(self) -> dict:
        """Greedy accuracy of the current policy on the validation problems, through the rollout
        backend (``eval_max_new_tokens`` per completion, the correctness reward); with several
        processes each answers every W-th problem and the counts are summed."""
        rows = self.val_problems[self.dist.rank::self.dist.world_size]
        prompts = [build_prompt(self.tokenizer, r["question"], self.cfg.system_prompt) for r in rows]
        t0 = time.perf_counter()
        self.sync_backend()
        texts = self.backend.generate(prompts, 1, max_new_tokens=self.cfg.checkpoints.eval_max_new_tokens,
                                      temperature=0.0).texts if rows else []
        self.backend.sleep()
        correct = REWARDS["correctness"](texts, [str(r["answer"]) for r in rows])
        counts = torch.tensor([float(sum(correct)), float(len(rows))], device=self.device)
        right, n = self.dist.all_reduce(counts).tolist()
        every = [x for part in self.dist.all_gather_object([(c > 0, cluster_key(r["question"]))
                                                            for r, c in zip(rows, correct)]) for x in part]
        return {"val_accuracy": right / max(n, 1.0), "val_n": int(n), **validation_interval(every),
                "time_validate_s": time.perf_counter() - t0}

    def eval_due(self) -> bool:
        """Validation after this step: every ``eval_every`` steps and after the last one."""
        every = self.cfg.checkpoints.eval_every
        return bool(every and self.val_problems) and (self.step % every == 0 or self.step == self.cfg.steps)

    # ------------------------------------------------------------------ the loop
    def save_checkpoint(self):
        return self.run.save_checkpoint(self.step, self.model, self.updater, self.scheduler,
                                        data_position=self.step * self.cfg.rollouts.prompts_per_step)

    def resume(self) -> None:
        """Load the newest intact checkpoint (none: step 0). Rank 0 reads it (damaged ones are
        logged and moved aside) and sends it to the other ranks (LoRA-sized), so only rank 0 needs
        ``output_dir`` (no shared filesystem across machines); then every rank holds rank 0's
        LoRA weights. Rank 0 truncates the run directory's logs to the step resumed."""
        ckpt = self.run.load_latest() if self.dist.is_main else None
        ckpt = self.dist.broadcast_object(ckpt)
        self.step = 0
        if ckpt is not None:
            if ckpt.data_position != ckpt.step * self.cfg.rollouts.prompts_per_step:
                raise checkpoint.CheckpointMismatch(f"{ckpt.path}: data position does not match prompts_per_step; "
                                                    f"delete {self.run.checkpoints}")
            checkpoint.restore(ckpt, self.model, self.updater, self.scheduler)
            self.step = ckpt.step
            log.info("resumed from %s (step %d)", ckpt.path, self.step)
        self.dist.broadcast_(self.params)  # the same start on every rank, however it was initialised
        if self.dist.is_main:
            self.history = self.run.resume_logs(self.step)
            for cb in self.callbacks:
                for row in self.history:
                    cb(row)

    def train(self, progress: bool = True) -> list[dict]:
        """Train to ``cfg.steps`` steps, resuming from the newest intact checkpoint; return all
        step rows. With several processes every rank runs this; rank 0 alone writes files and
        calls the callbacks."""
        main = self.dist.is_main
        self.resume()
        self.dist.start_steps(self.cfg.distribution.dist_timeout_s)  # start-up is over: a long wait now means a hung rank
        from tqdm import tqdm

        with tqdm(total=self.cfg.steps, initial=self.step, desc="train", unit="step",
                  disable=not (progress and main)) as bar:
            while self.step < self.cfg.steps:
                row = self.train_step()
                if self.eval_due():
                    row.update(self.validate())
                    if main:
                        self.run.keep_if_best(self.model, row, self.history)
                self.history.append(row)
                if main:
                    self.run.append(row, self.last_samples)
                    for cb in self.callbacks:
                        cb(row)
                    if self.cfg.checkpoints.every and self.step % self.cfg.checkpoints.every == 0 \
                            and not row.get("update_skipped"):  # a checkpoint is a step that updated
                        self.save_checkpoint()
                    bar.update(1)
                    bar.set_postfix(progress_postfix(self.history))
                self.guard.check(row, self.run.latest_checkpoint)  # logged first; every rank stops alike
                self.gap_guard.check(row)
        return self.history
