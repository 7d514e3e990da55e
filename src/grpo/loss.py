"""GRPO advantages and the clipped policy-gradient loss: pure tensor functions.

Algorithm (DeepSeekMath, arXiv 2402.03300, with the later variants named below). For each prompt
the policy samples a group of G completions with rewards r_1..r_G. The advantage of completion i
is its reward centred on the group mean, optionally divided by a standard deviation:

    A_i = (r_i - mean(r_group)) / (std + 1e-4)

A group whose rewards are all equal carries no learning signal and gets A = 0 exactly (no
invented baseline). Every completion token t then contributes the PPO-style clipped term

    rho_t = exp(logp_t - old_logp_t)
    l_t   = -min(rho_t * A, clip(rho_t, 1 - eps, 1 + eps_high) * A) + beta * KL_t
    KL_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1            (k3 estimator, always >= 0)

and the token terms are aggregated in one of three ways:

* ``grpo``    mean over each sequence's tokens, then mean over sequences (the paper).
* ``dr_grpo`` sum over all tokens / (N * T_max): no length normalisation (Dr. GRPO, arXiv 2503.20783).
* ``dapo``    sum over all tokens / number of valid tokens in the batch (DAPO, arXiv 2503.14476).

Departure from the paper: the KL term is optional (beta = 0 skips it and the reference pass).
When an inference engine samples the rollouts, ``token_weights`` (truncated importance weights
``min(pi_old / pi_engine, C)``) multiply the policy-gradient term of each token before the KL term
is added, correcting for the engine's slightly different numerics.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADV_EPS = 1e-4
LOSS_TYPES = ("grpo", "dr_grpo", "dapo")


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group") -> Tensor:
    """Group-relative advantages.

    rewards: (N,) with N = num_prompts * group_size, the G completions of a prompt contiguous.
    scale: ``group`` divides by each group's std, ``batch`` by the std of all N rewards,
    ``none`` only centres (Dr. GRPO). Returns (N,).
    """
    if rewards.ndim != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards of shape {tuple(rewards.shape)} do not split into groups of {group_size}")
    grouped = rewards.float().view(-1, group_size)  # (P, G)
    centred = grouped - grouped.mean(dim=1, keepdim=True)  # (P, G)
    if scale == "group":
        centred = centred / (grouped.std(dim=1, keepdim=True) + ADV_EPS)
    elif scale == "batch":
        centred = centred / (rewards.float().std() + ADV_EPS)
    elif scale != "none":
        raise ValueError(f"unknown advantage scale {scale!r}")
    return centred.view(-1)  # (N,)


def signal_groups(rewards: Tensor, group_size: int) -> Tensor:
    """(P,) bool: the groups of (N,) ``rewards`` (G contiguous completions each) whose rewards are
    not all equal, the only ones with non-zero advantages."""
    grouped = rewards.view(-1, group_size)  # (P, G)
    return (grouped != grouped[:, :1]).any(dim=1)  # (P,)


def loss_normalizer(mask: Tensor, loss_type: str, max_length: int | None = None) -> float:
    """The denominator of ``loss_type`` for a whole batch; pass it to every micro-batch's
    ``grpo_loss`` so that gradient accumulation sums to the full-batch loss."""
    if loss_type == "dapo":
        return float(mask.sum().clamp(min=1))
    if loss_type == "grpo":
        return float(mask.shape[0])
    if loss_type == "dr_grpo":
        return float(mask.shape[0] * (max_length or mask.shape[1]))
    raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")


def grpo_loss(
    logp: Tensor,
    old_logp: Tensor,
    ref_logp: Tensor | None,
    advantages: Tensor,
    mask: Tensor,
    *,
    epsilon: float = 0.2,
    epsilon_high: float | None = None,
    beta: float = 0.0,
    loss_type: str = "dapo",
    normalizer: float | None = None,
    max_length: int | None = None,
    token_weights: Tensor | None = None,
) -> tuple[Tensor, dict[str, float]]:
    """Clipped GRPO loss and its statistics.

    logp, old_logp, ref_logp: (N, T) log-probs of the sampled completion tokens under the current,
    the sampling-time and the reference policy. advantages: (N,). mask: (N, T), 1 on valid
    completion tokens. Positions where ``logp`` carries no gradient (e.g. tokens dropped by the
    entropy mask, filled with detached values) still count in the value and the normaliser, but
    contribute no gradient. ``normalizer`` overrides the aggregation denominator (micro-batching);
    ``max_length`` is T_max of ``dr_grpo`` (default: T). ``token_weights``: (N, T) importance
    weights of the policy-gradient term (no gradient flows into them).

    Returns the scalar loss and ``{"clip_frac", "clip_low_frac", "clip_high_frac", "kl", "ratio"}``,
    token means over the mask.
    """
    if loss_type not in LOSS_TYPES:
        raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {LOSS_TYPES}")
    eps_high = epsilon if epsilon_high is None else epsilon_high
    mask = mask.to(logp.dtype)  # (N, T)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)

    ratio = torch.exp(logp - old_logp)  # (N, T)
    clipped = torch.clamp(ratio, 1 - epsilon, 1 + eps_high)  # (N, T)
    per_token = -torch.min(ratio * adv, clipped * adv)  # (N, T)
    if token_weights is not None:
        per_token = per_token * token_weights.detach().to(per_token.dtype)
    kl = None
    if beta != 0.0:
        if ref_logp is None:
            raise ValueError("beta != 0 needs ref_logp")
        delta = ref_logp - logp  # (N, T)
        kl = torch.exp(delta) - delta - 1  # (N, T), k3 estimator
        per_token = per_token + beta * kl

    if normalizer is None:
        normalizer = loss_normalizer(mask, loss_type, max_length)
    if loss_type == "grpo":
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N,)
        loss = per_seq.sum() / normalizer
    else:  # dapo, dr_grpo: token sum over the batch, different denominators
        loss = (per_token * mask).sum() / normalizer

    return loss, clip_stats(ratio, adv, mask, kl, epsilon, eps_high)


@torch.no_grad()
def clip_stats(ratio: Tensor, adv: Tensor, mask: Tensor, kl: Tensor | None, epsilon: float,
               eps_high: float) -> dict[str, float]:
    """Token means over ``mask`` (N, T) of the clipped fractions, the ratio (N, T) and the k3 KL
    (N, T; 0 without one); ``adv``: (N, 1)."""
    n_tok = mask.sum().clamp(min=1)
    low = ((ratio < 1 - epsilon) & (adv < 0)).to(mask.dtype)  # clipped from below
    high = ((ratio > 1 + eps_high) & (adv > 0)).to(mask.dtype)  # clipped from above
    stats = {
        "clip_low_frac": float((low * mask).sum() / n_tok),
        "clip_high_frac": float((high * mask).sum() / n_tok),
        "ratio": float((ratio * mask).sum() / n_tok),
        "kl": float((kl * mask).sum() / n_tok) if kl is not None else 0.0,
    }
    stats["clip_frac"] = stats["clip_low_frac"] + stats["clip_high_frac"]
    return stats
