"""The GRPO training loop: rollouts, rewards, advantages, clipped updates; checkpoint and resume.

One optimizer step:

1. take the next ``prompts_per_step`` problems in the order given (the curriculum's order;
   the data position wraps around at the end),
2. sample G completions per prompt from the current policy (the rollout backend), at most
   ``generation_batch_size`` completions per call (prompts whole), then drop generation state (KV caches,
   allocator cache) before training,
3. score them with the weighted rewards and turn the scores into group-relative advantages,
4. if ``beta > 0``, reference log-probs with the LoRA adapter disabled (same weights, no copy);
   if ``mu > 1``, the sampling policy's log-probs (old_logp) once, before any update,
5. ``mu`` times: the entropy threshold over the whole step's valid completion tokens (from the
   no-grad pass when the step is split into micro-batches; from the one forward otherwise);
   then for each micro-batch, one body forward with grad (each group's prompt once, its
   completions on the shared KV cache), entropy and log-probs of all completion tokens without
   grad (chunked, fused kernel), the LM head with grad only at the tokens at or above the
   threshold, ``grpo_loss`` normalised over the whole step, backward; then clip the gradient
   norm and take an AdamW step on the LoRA parameters. Micro-batching changes memory and time,
   not the update: the kept tokens and the normaliser are the step's.

With ``mu = 1`` the old policy is the current one, so old_logp is the detached current log-prob
(ratio 1 in value, the usual on-policy gradient) and no extra pass is run.

Sampling: completion j of the step's prompt i draws from its own generator, seeded with
``sample_seed(seed, step, i, j)`` (the decode loop; an inference engine is seeded once instead),
so a step's samples do not depend on how its prompts are split into calls or processes.

Data parallel (``grpo.distributed.Dist``, ``world_size`` W > 1): rank r takes the r-th contiguous
``prompts_per_step / W`` prompts of the step (whole groups) and samples, scores and back-propagates
only those. Reduced over ranks, so that W processes make the update of one process with all
prompts: the rewards (all-gathered: the advantages with ``advantage_scale: batch`` and the logged
reward statistics see every completion), the loss normaliser (a sum of per-rank counts for every
``loss_type``), the entropy threshold (the valid tokens' entropies of all ranks are gathered and
the quantile taken over them: exact), the LoRA gradients (summed before clipping: every rank's loss
is already divided by the step-wide normaliser) and the logged sums (token-weighted statistics
summed, then divided by the global token count; times and memory: the largest rank's). Every
rank then clips the same gradient and takes the same AdamW step (with ``train.deepspeed_config``,
DeepSpeed ZeRO reduces, clips and steps instead: ``grpo.zero``). Rank 0 alone writes checkpoints,
the step log and the samples; on resume rank 0 reads the checkpoint (verifying it and moving
damaged ones aside) and sends it to every rank.

Checkpoints (every ``checkpoint_every`` steps, ``grpo.checkpoint``) hold the adapter, optimizer,
scheduler, RNG states, step and data position with a manifest of their checksums; they are written
to a temporary directory and renamed, so a ``kill -9`` leaves either a complete checkpoint or none.
``GRPOTrainer.train`` resumes from the newest one that verifies and loads (a damaged one is
reported, moved aside and skipped) and truncates the per-step log (``steps.jsonl``) and the
sampled completions (``samples.jsonl``) to it, so the resumed run repeats and skips nothing.
"""

from __future__ import annotations

import contextlib
import gc
import json
import logging
import math
import resource
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from grpo.config import TrainConfig
from grpo.curriculum import batch_indices, stage_of_step, stages_for
from grpo.data import build_prompt
from grpo.distributed import Dist
from grpo.entropy import entropy_threshold, high_entropy_mask
from grpo.logprobs import chunked_entropy_logprobs, completion_hidden, selected_logprobs
from grpo.loss import group_advantages, grpo_loss, loss_normalizer
from grpo.policy import lm_parts
from grpo.rewards import REWARDS, combined_rewards
from grpo.rollout import RolloutBackend, TransformersBackend
from grpo.types import Rollout, TrainBatch

log = logging.getLogger(__name__)

StepCallback = Callable[[dict], None]


def lr_lambda(cfg: TrainConfig) -> Callable[[int], float]:
    """Multiplier of the peak lr at scheduler step s: linear warm-up, then the chosen decay."""

    def fn(s: int) -> float:
        if s < cfg.warmup_steps:
            return (s + 1) / (cfg.warmup_steps + 1)
        if cfg.lr_schedule == "constant":
            return 1.0
        progress = min(1.0, (s - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
        if cfg.lr_schedule == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))

    return fn


def peak_memory_mb(device: torch.device) -> float:
    """Peak allocated CUDA memory, or the process's peak resident set size on the CPU (MB)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """Seed of completion ``sample`` of the step's prompt ``prompt`` (0-based, in the whole step)."""
    return int(np.random.SeedSequence([seed % 2**32, step, prompt, sample]).generate_state(1)[0])


def generation_calls(n_prompts: int, group_size: int, max_completions: int) -> list[tuple[int, int, int]]:
    """Split a step's generation into ``(first_prompt, end_prompt, samples_each)`` calls of at most
    ``max_completions`` completions (0: one call), keeping each call's prompts whole so that the
    backend prefills every prompt once: whole groups per call when a group fits, else one prompt
    per call with its G samples spread over several calls (G = 4, at most 3: 3 + 1 per prompt)."""
    g, size = group_size, max_completions
    if not size or size >= g * n_prompts:
        return [(0, n_prompts, g)]
    if size >= g:
        k = size // g  # whole groups per call
        return [(lo, min(lo + k, n_prompts), g) for lo in range(0, n_prompts, k)]
    return [(i, i + 1, min(size, g - s)) for i in range(n_prompts) for s in range(0, g, size)]


class GRPOTrainer:
    """Composes rollout, rewards, advantages and loss into optimizer steps over ``problems``."""

    def __init__(
        self,
        model,
        tokenizer,
        cfg: TrainConfig,
        problems: list[dict],
        *,
        backend: RolloutBackend | None = None,
        callbacks: list[StepCallback] | None = None,
        val_problems: list[dict] | None = None,
        dist: Dist | None = None,
    ):
        self.model = model
        self.dist = dist or Dist()  # one process unless given
        self.dist.shard(cfg.prompts_per_step)  # fails early unless the prompts split evenly
        self.tokenizer = tokenizer
        self.cfg = cfg
        self.problems = problems
        self.stages = stages_for(cfg.order, len(problems), cfg.num_stages, cfg.seed)
        self.device = next(model.parameters()).device
        self.backend = backend or TransformersBackend(model, tokenizer, dequantize=self.device.type == "cpu")
        self.callbacks = callbacks or []
        self.val_problems = val_problems or []
        self._synced_step: int | None = None  # the step whose weights the backend's engine holds
        self.body, self.lm_head = lm_parts(model)
        self.shared_group = cfg.group_size if cfg.shared_prompt_forward else 1  # see completion_hidden
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.zero = None  # with train.deepspeed_config: DeepSpeed takes the update (grpo.zero)
        if cfg.deepspeed_config:
            from grpo.zero import ZeroUpdate

            self.zero = ZeroUpdate(model, self.params, cfg, self.dist)
        # the optimizer as checkpoints see it (with DeepSpeed: grpo.zero's stand-in) and as the schedule steps it
        self.optimizer = self.zero or torch.optim.AdamW(self.params, lr=cfg.lr, weight_decay=cfg.weight_decay)
        lr_target = self.zero.optimizer if self.zero else self.optimizer
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(lr_target, lr_lambda(cfg))
        self.out = Path(cfg.output_dir)
        self.ckpt_dir = self.out / "checkpoints"
        self.log_path = self.out / "steps.jsonl"
        self.samples_path = self.out / "samples.jsonl"
        self.last_samples: list[dict] = []
        self.step = 0
        self.history: list[dict] = []

    # ------------------------------------------------------------------ data
    def batch_rows(self, step: int) -> list[dict]:
        """Problems of 0-based ``step`` (see ``grpo.curriculum.batch_indices``)."""
        idx = batch_indices(self.stages, step, self.cfg.steps, self.cfg.prompts_per_step)
        return [self.problems[i] for i in idx]

    # ------------------------------------------------------------------ rollouts
    def rollout(self, prompts: list[str], first_prompt: int = 0) -> Rollout:
        """G completions of each prompt (contiguous per prompt), at most ``generation_batch_size``
        completions per ``generate`` call (see ``generation_calls``); 0: one call for the step.
        ``first_prompt``: the index of ``prompts[0]`` in the whole step (for ``sample_seed``)."""
        cfg, g = self.cfg, self.cfg.group_size
        sampling = dict(max_new_tokens=cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p)
        calls = generation_calls(len(prompts), g, cfg.generation_batch_size)
        self.sync_backend()
        drawn = [0] * len(prompts)  # completions of each prompt sampled so far
        parts = []
        for lo, hi, n in calls:
            seeds = [sample_seed(cfg.seed, self.step, first_prompt + i, drawn[i] + j)
                     for i in range(lo, hi) for j in range(n)]
            drawn[lo:hi] = [k + n for k in drawn[lo:hi]]
            parts.append(self.backend.generate(prompts[lo:hi], n, seeds=seeds, **sampling))
        rollout = Rollout.concat(parts, self.tokenizer.pad_token_id)
        del parts
        self._backend_sleep()
        if cfg.release_generation_memory:
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        return rollout

    def sync_backend(self) -> None:
        """Bring an engine backend's weights to the policy's current ones (once per step; the
        project's own decode loop samples from the policy itself and needs nothing)."""
        if hasattr(self.backend, "sync") and self._synced_step != self.step:
            self.backend.sync(self.model)
            self._synced_step = self.step

    def _backend_sleep(self) -> None:
        """An engine backend frees its accelerator memory for the update (it wakes on its next call)."""
        if hasattr(self.backend, "sleep"):
            self.backend.sleep()

    def validate(self) -> dict:
        """Greedy accuracy of the current policy on the validation problems, through the rollout
        backend (``eval_max_new_tokens`` per completion, the correctness reward); with several
        processes each answers every W-th problem and the counts are summed."""
        rows = self.val_problems[self.dist.rank::self.dist.world_size]
        prompts = [build_prompt(self.tokenizer, r["question"], self.cfg.system_prompt) for r in rows]
        t0 = time.perf_counter()
        self.sync_backend()
        texts = self.backend.generate(prompts, 1, max_new_tokens=self.cfg.eval_max_new_tokens,
                                      temperature=0.0).texts if rows else []
        self._backend_sleep()
        correct = REWARDS["correctness"](texts, [str(r["answer"]) for r in rows])
        right, n = self.dist.all_reduce(torch.tensor([float(sum(correct)), float(len(rows))], device=self.device)).tolist()
        return {"val_accuracy": right / max(n, 1.0), "val_n": int(n), "time_validate_s": time.perf_counter() - t0}

    def eval_due(self) -> bool:
        """Validation after this step: every ``eval_every`` steps and after the last one."""
        every = self.cfg.eval_every
        return bool(every and self.val_problems) and (self.step % every == 0 or self.step == self.cfg.steps)

    # ------------------------------------------------------------------ no-grad passes
    @torch.no_grad()
    def _no_grad_pass(self, batch: TrainBatch, *, adapter: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(N, C) entropies and (N, C) log-probs of the targets without grad, micro-batch by
        micro-batch (the same slices as the update); adapter off = the reference policy."""
        entropies, logps = [], []
        for sl in self._micro_slices(len(batch)):
            part = batch[sl]
            with contextlib.nullcontext() if adapter else self.model.disable_adapter():
                hidden = completion_hidden(self.body, part.input_ids, part.attention_mask, part.prompt_len,
                                           self.shared_group)  # (n, C, H)
            entropy, logp = chunked_entropy_logprobs(hidden, self.lm_head, part.targets, self.cfg.logprob_chunk,
                                                     self.cfg.kernel)  # (n, C) each
            entropies.append(entropy)
            logps.append(logp)
        return torch.cat(entropies), torch.cat(logps)

    def step_threshold(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The entropy threshold of the whole step from this rank's (N, C) token entropies and mask:
        the valid entropies of every rank are gathered (a collective) and the quantile is taken
        over all of them, exactly as one process with the whole step would."""
        if self.cfg.entropy_top_quantile >= 1:
            return None
        values = self.dist.all_gather_cat(entropy[mask.bool()].float())  # (valid tokens of the step,)
        return entropy_threshold(values, self.cfg.entropy_top_quantile)

    def _micro_slices(self, n: int) -> list[slice]:
        """``micro_batches`` slices of the N rows, whole groups each where possible (shared prompts)."""
        size = math.ceil(n / self.cfg.micro_batches)
        if size % self.cfg.group_size and size > self.cfg.group_size:
            size = math.ceil(size / self.cfg.group_size) * self.cfg.group_size
        return [slice(i, min(n, i + size)) for i in range(0, n, size)]

    # ------------------------------------------------------------------ one micro-batch
    def policy_loss_backward(
        self, batch: TrainBatch, normalizer: float, threshold: torch.Tensor | None = None
    ) -> tuple[float, dict, torch.Tensor, torch.Tensor]:
        """Forward with grad, entropy mask, GRPO loss and backward for one micro-batch.

        ``normalizer``: the step-wide token normaliser (``loss_normalizer``); ``threshold``: the
        step-wide entropy threshold, or ``None`` when ``batch`` is the whole step (it is then taken
        here, over these rows). Returns the loss value, its stats, the token entropies (n, C) and
        the kept mask (n, C).
        """
        cfg = self.cfg
        hidden = completion_hidden(self.body, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                   self.shared_group)  # (n, C, H)
        entropy, logp_all = chunked_entropy_logprobs(
            hidden.detach(), self.lm_head, batch.targets, cfg.logprob_chunk, cfg.kernel
        )  # (n, C) each, no grad
        if threshold is None:
            threshold = self.step_threshold(entropy, batch.mask)
        keep = high_entropy_mask(entropy, batch.mask, cfg.entropy_top_quantile, threshold)  # (n, C) bool
        kept_logp = selected_logprobs(hidden[keep], self.lm_head, batch.targets[keep])  # (K,)
        logp = logp_all.masked_scatter(keep, kept_logp)  # (n, C), grad only where kept
        old_logp = batch.old_logp if batch.old_logp is not None else logp_all  # (n, C), no grad
        weights, mismatch = None, {}
        if batch.sampling_logp is not None:  # an engine sampled: how far its numbers are from ours
            valid = batch.mask.bool()
            gap = (old_logp - batch.sampling_logp).abs()[valid]  # (n_valid,)
            mismatch = {"mismatch_sum": float(gap.sum()), "mismatch_max": float(gap.max()) if gap.numel() else 0.0}
            if cfg.importance_sampling_correction:
                weights = torch.exp(old_logp - batch.sampling_logp).clamp(max=cfg.importance_sampling_cap)  # (n, C)
                mismatch["is_weight_sum"] = float(weights[valid].sum())
        loss, stats = grpo_loss(
            logp,
            old_logp,
            batch.ref_logp,
            batch.advantages,
            batch.mask,
            epsilon=cfg.epsilon,
            epsilon_high=cfg.epsilon_high,
            beta=cfg.beta,
            loss_type=cfg.loss_type,
            normalizer=normalizer,
            max_length=cfg.max_new_tokens,
            token_weights=weights,
        )
        if self.zero:
            self.zero.backward(loss)  # on every rank equally often (ZeRO reduces in each backward)
        elif loss.requires_grad:
            loss.backward()
        return loss.item(), {**stats, **mismatch}, entropy, keep

    # ------------------------------------------------------------------ one update
    def accumulate_gradients(
        self, batch: TrainBatch, normalizer: float, policy_entropy: torch.Tensor | None = None
    ) -> tuple[dict, torch.Tensor]:
        """Backward of one update over the whole step, micro-batch by micro-batch (gradients add up
        in ``.grad``; no optimizer step). The entropy threshold is the step's: taken in the one
        forward when there is one micro-batch, else from ``policy_entropy`` ((N, C), the no-grad
        pass at the current weights), computed here when not given.

        Returns sums over the step (loss; token-weighted kl, clip_frac, ratio; entropy and kept
        token totals; with engine rollouts the summed and largest absolute difference between the
        trainer's and the engine's log-probs of the sampled tokens, and the summed importance
        weights) and the (N, C) kept mask.
        """
        mask, slices = batch.mask, self._micro_slices(len(batch))
        threshold = None
        if len(slices) > 1:
            if policy_entropy is None:
                policy_entropy = self._no_grad_pass(batch, adapter=True)[0]
            threshold = self.step_threshold(policy_entropy, mask)
        sums = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio": 0.0, "entropy": 0.0, "kept": 0.0}
        kept = []
        for sl in slices:
            loss, stats, entropy, keep = self.policy_loss_backward(batch[sl], normalizer, threshold)
            m = mask[sl]
            n_tok = float(m.sum())
            for key in ("mismatch_sum", "is_weight_sum"):
                if key in stats:
                    sums[key] = sums.get(key, 0.0) + stats[key]
            if "mismatch_max" in stats:
                sums["mismatch_max"] = max(sums.get("mismatch_max", 0.0), stats["mismatch_max"])
            sums["loss"] += loss
            for key in ("kl", "clip_frac", "ratio"):
                sums[key] += stats[key] * n_tok
            sums["entropy"] += float((entropy * m).sum())
            sums["kept"] += float(keep.sum())
            kept.append(keep)
        return sums, torch.cat(kept)

    def gather_rewards(self, total: list[float], per_fn: dict[str, list[float]]) -> tuple[torch.Tensor, dict]:
        """The rewards of the whole step from this rank's: ``total`` (n,) and ``per_fn`` name ->
        (n,) -> the (N,) totals and name -> (N,) lists, in prompt order (ranks hold contiguous
        prompts; one process: returned as they are)."""
        if not self.dist.active:
            return torch.tensor(total, dtype=torch.float32), per_fn
        names = sorted(per_fn)
        local = torch.tensor([total, *(per_fn[k] for k in names)], dtype=torch.float32, device=self.device)  # (1+F, n)
        rows = self.dist.all_gather_cat(local.reshape(-1)).view(self.dist.world_size, *local.shape)  # (W, 1+F, n)
        full = rows.permute(1, 0, 2).reshape(local.shape[0], -1).cpu()  # (1+F, N)
        return full[0], {k: full[i + 1].tolist() for i, k in enumerate(names)}

    def step_normalizer(self, mask: torch.Tensor) -> float:
        """The ``loss_type`` denominator of the whole step from this rank's (n, C) completion mask:
        every type's is a sum over completions (valid tokens; rows; rows x ``max_new_tokens``), so
        the per-rank values are summed."""
        local = loss_normalizer(mask, self.cfg.loss_type, self.cfg.max_new_tokens)
        return float(self.dist.all_reduce(torch.tensor(local, dtype=torch.float64, device=self.device)))

    def reduce_gradients(self) -> dict[str, float]:
        """Sum the LoRA gradients over ranks, in one flat all-reduce, before clipping (each rank's
        loss is divided by the step-wide normaliser, so the sum is one process's gradient).
        Returns the seconds spent waiting for the slowest rank and in the all-reduce itself."""
        if not self.dist.active:
            return {"wait": 0.0, "allreduce": 0.0}
        t0 = time.perf_counter()
        self.dist.barrier()
        t1 = time.perf_counter()
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in self.params]
        summed = self.dist.all_reduce_many(grads, dtype=torch.float32)  # one flat fp32 all-reduce, (n_lora,)
        for p, g in zip(self.params, summed):
            p.grad = g.to(p.dtype).clone()
        return {"wait": t1 - t0, "allreduce": time.perf_counter() - t1}

    def reduce_metrics(self, sums: dict[str, float], maxes: dict[str, float]) -> tuple[dict, dict]:
        """``sums`` summed and ``maxes`` maximised over ranks (same keys on every rank)."""
        out = []
        for values, op in ((sums, "sum"), (maxes, "max")):
            keys = sorted(values)
            t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=self.device)
            reduced = dict(zip(keys, self.dist.all_reduce(t, op).tolist()))
            out.append({k: reduced[k] for k in values})  # in the given order
        return out[0], out[1]

    # ------------------------------------------------------------------ one step
    def train_step(self) -> dict:
        """Run one optimizer step (``self.step`` -> ``self.step + 1``) and return its log row (the
        whole step's, the same on every rank up to the per-rank times)."""
        cfg, g = self.cfg, self.cfg.group_size
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        t0 = time.perf_counter()
        stage = stage_of_step(self.step, cfg.steps, len(self.stages))  # the stage batch_rows draws from
        all_rows = self.batch_rows(self.step)
        mine = self.dist.shard(len(all_rows))  # this rank's prompts (all of them for one process)
        rows = all_rows[mine]
        prompts = [build_prompt(self.tokenizer, r["question"], cfg.system_prompt) for r in rows]
        answers = [str(r["answer"]) for r in rows for _ in range(g)]
        rollout = self.rollout(prompts, first_prompt=mine.start)
        t_gen = time.perf_counter()

        total, per_fn = combined_rewards(rollout.texts, answers, cfg.rewards)
        if "correctness" not in per_fn:
            per_fn["correctness"] = REWARDS["correctness"](rollout.texts, answers)
        rewards, per_fn = self.gather_rewards(total, per_fn)  # (N_step,) over all ranks
        advantages = group_advantages(rewards, g, cfg.advantage_scale)  # (N_step,)
        local = slice(mine.start * g, mine.stop * g)  # this rank's completions
        batch = TrainBatch.from_rollout(rollout, advantages[local], self.device)
        mask = batch.mask  # (n, C)
        normalizer = self.step_normalizer(mask)

        policy_entropy = None  # (n, C) at the current weights, when a no-grad pass has computed it
        if cfg.beta:
            batch.ref_logp = self._no_grad_pass(batch, adapter=False)[1]
        if cfg.mu > 1:
            policy_entropy, batch.old_logp = self._no_grad_pass(batch, adapter=True)
        t_ref = time.perf_counter()

        self.model.train()
        sums = {"loss": 0.0, "kl": 0.0, "clip_frac": 0.0, "ratio": 0.0, "entropy": 0.0, "kept": 0.0}
        grad_norm, t_optimizer, t_wait, t_allreduce = 0.0, 0.0, 0.0, 0.0
        for i in range(cfg.mu):
            update, _ = self.accumulate_gradients(batch, normalizer, policy_entropy)
            policy_entropy = None  # the weights change with this update
            for key, value in update.items():
                if key in sums:
                    sums[key] += value / cfg.mu
                elif i == 0:  # the sampler/trainer gap, before any update moves the policy
                    sums[key] = value
            if self.zero:  # DeepSpeed reduces, clips and steps (grpo.zero)
                t_opt = time.perf_counter()
                grad_norm = self.zero.step()
            else:
                reduced = self.reduce_gradients()
                t_wait, t_allreduce = t_wait + reduced["wait"], t_allreduce + reduced["allreduce"]
                t_opt = time.perf_counter()
                grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, cfg.max_grad_norm))
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
            t_optimizer += time.perf_counter() - t_opt
        lr = self.scheduler.get_last_lr()[0]
        self.scheduler.step()
        t_end = time.perf_counter()

        self.step += 1
        samples = [
            {"step": self.step, "question": rows[i // g]["question"], "answer": answers[i], "completion": text,
             "reward": total[i]}
            for i, text in enumerate(rollout.texts)
        ]
        self.last_samples = [s for part in self.dist.all_gather_object(samples) for s in part]
        mismatch_max = sums.pop("mismatch_max", None)
        sums.update(n_valid=float(mask.sum()), n_rows=float(len(batch)))
        times = {"time_generate_s": t_gen - t0, "time_logprob_s": t_ref - t_gen, "time_update_s": t_end - t_ref,
                 "time_optimizer_s": t_optimizer, "step_time_s": t_end - t0, "peak_mem_mb": peak_memory_mb(self.device)}
        if self.device.type == "cuda":
            times["peak_reserved_mb"] = torch.cuda.max_memory_reserved(self.device) / 2**20
        if mismatch_max is not None:
            times["mismatch_max"] = mismatch_max
        sums, maxes = self.reduce_metrics(sums, times)
        n_valid = max(1.0, sums["n_valid"])
        grouped = rewards.view(-1, g)
        row = {
            "step": self.step,
            "stage": stage,
            "reward_mean": float(rewards.mean()),
            "reward_std": float(rewards.std()),
            "accuracy": float(np.mean(per_fn["correctness"])),
            **{f"reward_{k}_mean": float(np.mean(v)) for k, v in per_fn.items()},
            **{f"reward_{k}_std": float(np.std(v)) for k, v in per_fn.items()},
            "loss": sums["loss"],
            "kl": sums["kl"] / n_valid,
            "clip_frac": sums["clip_frac"] / n_valid,
            "ratio": sums["ratio"] / n_valid,
            "entropy_mean": sums["entropy"] / n_valid,
            "kept_frac": sums["kept"] / n_valid,
            **({"logp_mismatch_mean": sums["mismatch_sum"] / n_valid, "logp_mismatch_max": maxes.pop("mismatch_max")}
               if "mismatch_sum" in sums else {}),
            **({"is_weight_mean": sums["is_weight_sum"] / n_valid} if "is_weight_sum" in sums else {}),
            "completion_len": sums["n_valid"] / sums["n_rows"],
            "zero_std_frac": float((grouped.std(dim=1) == 0).float().mean()),
            "grad_norm": grad_norm,
            "lr": lr,
            **maxes,  # times and peak memory: the slowest / largest rank's
            "time_wait_s": t_wait,  # this rank's wait for the slowest one before the gradient all-reduce
            "time_allreduce_s": t_allreduce,  # the all-reduce itself (both 0 with one process)
        }
        return row

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self) -> Path:
        """Write ``checkpoints/step_XXXXXX`` atomically with its manifest; keep the two newest
        (``grpo.checkpoint.save``)."""
        from grpo import checkpoint

        return checkpoint.save(self.ckpt_dir, self.step, self.model, self.optimizer, self.scheduler,
                               data_position=self.step * self.cfg.prompts_per_step)

    def latest_checkpoint(self) -> Path | None:
        """The newest checkpoint whose files match its manifest (nothing is moved or loaded)."""
        from grpo import checkpoint

        return checkpoint.latest(self.ckpt_dir)

    def load_checkpoint(self, path: Path) -> None:
        """Verify and load the checkpoint at ``path`` into the model, optimizer, scheduler, RNGs
        and ``self.step``. Raises ``CheckpointError`` if it is damaged (nothing changed) and
        ``CheckpointMismatch`` if it was written with other LoRA or ``prompts_per_step`` settings."""
        from grpo import checkpoint

        self._restore(checkpoint.read(path, self.device))

    def _restore(self, ckpt) -> None:
        """Apply a ``grpo.checkpoint.Checkpoint`` that was read and verified."""
        from grpo import checkpoint

        if ckpt.data_position != ckpt.step * self.cfg.prompts_per_step:
            raise checkpoint.CheckpointMismatch(
                f"{ckpt.path}: data position does not match prompts_per_step; delete {self.ckpt_dir}"
            )
        checkpoint.restore(ckpt, self.model, self.optimizer, self.scheduler)
        self.step = ckpt.step

    def _restore_history(self) -> None:
        """Per-step rows and samples up to ``self.step``; later ones (after the checkpoint) are dropped."""
        from grpo.checkpoint import truncate_jsonl

        self.history = truncate_jsonl(self.log_path, self.step)
        truncate_jsonl(self.samples_path, self.step)

    # ------------------------------------------------------------------ loop
    @property
    def best_dir(self) -> Path:
        return self.out / "best_adapter"

    def _keep_if_best(self, row: dict) -> None:
        """With ``keep_best``, save the adapter when validation accuracy beats every earlier one."""
        if not self.cfg.keep_best:
            return
        earlier = [r["val_accuracy"] for r in self.history if "val_accuracy" in r]
        if earlier and row["val_accuracy"] <= max(earlier) and self.best_dir.exists():
            return
        tmp = self.best_dir.with_name(self.best_dir.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        self.model.save_pretrained(tmp)
        (tmp / "selection.json").write_text(json.dumps(
            {"adapter": "best validation accuracy", "step": self.step, "val_accuracy": row["val_accuracy"]}) + "\n")
        shutil.rmtree(self.best_dir, ignore_errors=True)
        tmp.rename(self.best_dir)

    def _resume(self) -> None:
        """Load the newest intact checkpoint (none: step 0). Rank 0 reads it (damaged ones are
        logged and moved aside) and sends it to the other ranks (adapter, optimizer, scheduler and
        RNG states: LoRA-sized), so only rank 0 needs ``output_dir`` (no shared filesystem across
        machines); then every rank holds rank 0's LoRA weights."""
        from grpo import checkpoint

        ckpt = checkpoint.load_latest(self.ckpt_dir, "cpu") if self.dist.is_main else None
        ckpt = self.dist.broadcast_object(ckpt)
        if ckpt is not None:
            self._restore(ckpt)
            log.info("resumed from %s (step %d)", ckpt.path, self.step)
        else:
            self.step = 0
        self.dist.broadcast_(self.params)  # the same start on every rank, however it was initialised

    def train(self, progress: bool = True) -> list[dict]:
        """Train to ``cfg.steps`` steps, resuming from the newest intact checkpoint (damaged ones
        are logged, moved aside and skipped; none left: step 0); return all step rows. With several
        processes every rank runs this; rank 0 alone writes files and calls the callbacks."""
        main = self.dist.is_main
        if main:
            self.out.mkdir(parents=True, exist_ok=True)
        self._resume()
        if main:
            self._restore_history()
            selection = self.best_dir / "selection.json"
            if selection.exists() and json.loads(selection.read_text())["step"] > self.step:
                shutil.rmtree(self.best_dir)  # saved after the checkpoint we resumed from: not this run's
            for cb in self.callbacks:
                for row in self.history:
                    cb(row)
        bar = None
        if progress and main:
            from tqdm import tqdm

            bar = tqdm(total=self.cfg.steps, initial=self.step, desc="train", unit="step")
        with open(self.log_path, "a") if main else contextlib.nullcontext() as fh:
            while self.step < self.cfg.steps:
                row = self.train_step()
                if self.eval_due():
                    row.update(self.validate())
                    if main:
                        self._keep_if_best(row)
                self.history.append(row)
                if not main:
                    continue
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                with open(self.samples_path, "a") as sf:
                    sf.writelines(json.dumps(x) + "\n" for x in self.last_samples)
                for cb in self.callbacks:
                    cb(row)
                if self.cfg.checkpoint_every and self.step % self.cfg.checkpoint_every == 0:
                    self.save_checkpoint()
                if bar is not None:
                    bar.update(1)
                    bar.set_postfix(reward=f"{row['reward_mean']:.3f}", acc=f"{row['accuracy']:.3f}")
        if bar is not None:
            bar.close()
        return self.history
