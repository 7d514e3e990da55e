"""GRPO advantages and the policy-gradient loss: pure tensor functions.

Algorithm (DeepSeekMath, arXiv 2402.03300, with the later variants named below). For each prompt
the policy samples a group of G completions with rewards r_1..r_G. The advantage of completion i
is its reward centred on the group mean, optionally divided by a standard deviation:

    A_i = (r_i - mean(r_group)) / (std + 1e-4)

A group whose rewards are all equal carries no learning signal and gets A = 0 exactly (no
invented baseline).

The loss has two axes, each a registry (as verl's ``core_algos.py``): the per-token policy term
(``POLICY_LOSSES``, ``train.loss.policy_loss``) and how the token terms become one number
(``AGGREGATIONS``, ``train.loss.loss_type``), the names turned into the entries once per run by
``build_loss`` (a frozen ``LossSettings`` with the clip range, beta and T_max). ``grpo_loss`` composes
them: policy term -> token importance weights -> + beta * k3 KL (+ a token-entropy rule's per-token
KL) -> aggregation, the per-token inputs of a batch in one ``LossTerms``. The one policy loss, ``clipped``, is the
PPO-style clipped term of every completion token t:

    rho_t = exp(logp_t - old_logp_t)
    l_t   = -min(rho_t * A, clip(rho_t, 1 - eps, 1 + eps_high) * A) + beta * KL_t
    KL_t  = exp(ref_t - logp_t) - (ref_t - logp_t) - 1            (k3 estimator, always >= 0)

and the aggregations are:

* ``grpo``    mean over each sequence's tokens, then mean over sequences (the paper).
* ``dr_grpo`` sum over all tokens / (N * T_max): no length normalisation (Dr. GRPO, arXiv 2503.20783).
* ``dapo``    sum over all tokens / number of valid tokens in the batch (DAPO, arXiv 2503.14476).

Departure from the paper: the KL term is optional (beta = 0 skips it and the reference pass,
unless the token-entropy rule puts a KL on some tokens: ``grpo.algorithm.entropy``, ``archer`` and ``sent_kl``).
When an inference engine samples the rollouts, ``token_weights`` (truncated importance weights
``min(pi_old / pi_engine, C)``) multiply the policy-gradient term of each token before the KL term
is added, correcting for the engine's slightly different numerics.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Annotated, ClassVar, NamedTuple, Protocol

import torch
from pydantic import Field
from torch import Tensor

from grpo.core.fields import PositiveFloat, Section
from grpo.core.registry import Registry

if TYPE_CHECKING:
    from grpo.config.sections.train_parts import LossConfig

ADV_EPS = 1e-4


class PolicyLoss(Protocol):
    """An entry of ``POLICY_LOSSES``: the per-token policy-gradient term and its statistics.

    ``logp``, ``old_logp``: (N, T) log-probs under the current and the sampling-time policy;
    ``advantages``: (N, 1); ``mask``: (N, T), 1.0 on valid completion tokens (all three in
    ``logp``'s dtype); ``epsilon``, ``epsilon_high``: the clip range's two sides, floats (or (N, T)
    tensors of per-token bounds: ``torch.clamp`` and the statistics take either). Returns the (N, T)
    term, whose gradient is the policy gradient (the mask, the weights, the KL and the aggregation
    are ``grpo_loss``'s), and its statistics as token means over the mask (the metric names of
    ``grpo.training.metrics.UPDATE``: ``clip_frac``, ``ratio`` ...; a statistic not given is absent)."""

    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                 epsilon: float | Tensor, epsilon_high: float | Tensor) -> tuple[Tensor, dict[str, float]]: ...


class Aggregation(Protocol):
    """An entry of ``AGGREGATIONS``: how the (N, T) token terms become the scalar loss.

    ``normalizer(mask, max_length)`` is the denominator of a batch (``mask``: (N, T); ``max_length``:
    T_max, ``None`` for T). CONTRACT: it is a sum over completions, each row adding its own part
    (valid tokens, 1, T_max ...), so the normaliser of a step split over micro-batches and
    processes is the sum of the parts' (``grpo.training.passes.PolicyPasses.step_normalizer`` adds them).
    ``aggregate(per_token, mask, normalizer)`` is the loss: a sum over the rows of ``per_token``
    (N, T) within ``mask`` divided by ``normalizer``, so the micro-batches' losses, each divided by
    the step's normaliser, add up to the step's loss (gradient accumulation)."""

    def normalizer(self, mask: Tensor, max_length: int | None) -> float: ...

    def aggregate(self, per_token: Tensor, mask: Tensor, normalizer: float) -> Tensor: ...


POLICY_LOSSES: Registry[PolicyLoss] = Registry("train.loss.policy_loss", "policy loss")
"""Policy-loss name -> ``PolicyLoss`` (``train.loss.policy_loss``)."""
AGGREGATIONS: Registry[Aggregation] = Registry("train.loss.loss_type", "loss aggregation")
"""Aggregation name -> ``Aggregation`` (``train.loss.loss_type``)."""


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


# ---------------------------------------------------------------------- policy losses
class ClippedOptions(Section):
    """``train.loss.policy_loss_options.clipped``: the clip range of the ratio."""

    SECTION: ClassVar[str] = "train.loss.policy_loss_options.clipped"
    epsilon: PositiveFloat = 0.2
    """Lower clip of the ratio: ``1 - epsilon``."""
    epsilon_high: Annotated[float, Field(gt=0)] | None = None
    """Upper clip ``1 + epsilon_high`` (DAPO clip-higher); ``null`` means ``epsilon``."""


@POLICY_LOSSES.register("clipped")
def clipped(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, epsilon: float | Tensor,
            epsilon_high: float | Tensor) -> tuple[Tensor, dict[str, float]]:
    """PPO's clipped surrogate: ``-min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A)``
    with ``rho = exp(logp - old_logp)``; statistics ``clip_low_frac``, ``clip_high_frac``,
    ``clip_frac`` and ``ratio``."""
    ratio = torch.exp(logp - old_logp)  # (N, T)
    clipped_ratio = torch.clamp(ratio, 1 - epsilon, 1 + epsilon_high)  # (N, T)
    per_token = -torch.min(ratio * advantages, clipped_ratio * advantages)  # (N, T)
    return per_token, clip_stats(ratio, advantages, mask, epsilon, epsilon_high)


clipped.Options = ClippedOptions


def clip_sides(ratio: Tensor, adv: Tensor, epsilon: float | Tensor, eps_high: float | Tensor) -> tuple[Tensor, Tensor]:
    """(N, T) bool each: the tokens the clip cuts from below (``ratio < 1 - epsilon``, ``A < 0``) and
    from above (``ratio > 1 + eps_high``, ``A > 0``), the sides on which it removes the gradient;
    ``adv``: (N, 1)."""
    return (ratio < 1 - epsilon) & (adv < 0), (ratio > 1 + eps_high) & (adv > 0)


@torch.no_grad()
def clip_stats(ratio: Tensor, adv: Tensor, mask: Tensor, epsilon: float | Tensor,
               eps_high: float | Tensor) -> dict[str, float]:
    """Token means over ``mask`` (N, T) of the clipped fractions and the ratio (N, T); ``adv``: (N, 1)."""
    low, high = (side.to(mask.dtype) for side in clip_sides(ratio, adv, epsilon, eps_high))
    stats = {"clip_low_frac": token_mean(low, mask), "clip_high_frac": token_mean(high, mask),
             "ratio": token_mean(ratio, mask)}
    stats["clip_frac"] = stats["clip_low_frac"] + stats["clip_high_frac"]
    return stats


@torch.no_grad()
def wide_clip_band(ratio: Tensor, adv: Tensor, mask: Tensor, epsilon: float, epsilon_high: float,
                   rule_epsilon: Tensor, rule_epsilon_high: Tensor) -> tuple[Tensor, Tensor]:
    """Where a token-entropy rule's wider clip (archer's high-entropy tokens) changes the update.

    ``ratio``: (N, T) pi / pi_old; ``adv``: (N, 1); ``mask``: (N, T); ``epsilon``, ``epsilon_high``:
    the ordinary clip (``clipped``'s options, ``LossConfig.clip``); ``rule_epsilon``,
    ``rule_epsilon_high``: (N, T) the rule's per-token bounds (``grpo.algorithm.entropy.LossTerms``). Returns
    two (N, T) bool masks within ``mask``: ``wide``, the tokens whose rule bound is wider than the
    ordinary one on either side, and ``band``, those of them that plain PPO would clip and the rule
    does not: ``A > 0`` and ``1 + epsilon_high < ratio <= 1 + rule_epsilon_high``, or ``A < 0`` and
    ``1 - rule_epsilon <= ratio < 1 - epsilon`` (the sides on which the clip removes the gradient,
    as ``clip_stats`` counts them)."""
    valid = mask.bool()
    wide = ((rule_epsilon > epsilon) | (rule_epsilon_high > epsilon_high)) & valid
    above = (adv > 0) & (ratio > 1 + epsilon_high) & (ratio <= 1 + rule_epsilon_high)
    below = (adv < 0) & (ratio < 1 - epsilon) & (ratio >= 1 - rule_epsilon)
    return wide, wide & (above | below)


@torch.no_grad()
def token_mean(values: Tensor, mask: Tensor) -> float:
    """The mean of (N, T) ``values`` over the valid tokens of ``mask`` (0 without any)."""
    return float((values * mask).sum() / mask.sum().clamp(min=1))


# ---------------------------------------------------------------------- aggregations
@AGGREGATIONS.register("grpo")
class SequenceMean:
    """Mean over each sequence's valid tokens, then over the sequences: one per row."""

    @staticmethod
    def normalizer(mask: Tensor, max_length: int | None) -> float:
        return float(mask.shape[0])

    @staticmethod
    def aggregate(per_token: Tensor, mask: Tensor, normalizer: float) -> Tensor:
        per_seq = (per_token * mask).sum(1) / mask.sum(1).clamp(min=1)  # (N,)
        return per_seq.sum() / normalizer


class TokenSum:
    """Sum over every valid token of the batch, divided by the normaliser."""

    @staticmethod
    def aggregate(per_token: Tensor, mask: Tensor, normalizer: float) -> Tensor:
        return (per_token * mask).sum() / normalizer


@AGGREGATIONS.register("dr_grpo")
class TokenSumOverMaxLength(TokenSum):
    """Token sum / (rows x T_max): no length normalisation."""

    @staticmethod
    def normalizer(mask: Tensor, max_length: int | None) -> float:
        return float(mask.shape[0] * (max_length or mask.shape[1]))


@AGGREGATIONS.register("dapo")
class TokenMean(TokenSum):
    """Token sum / valid tokens of the batch: the token mean."""

    @staticmethod
    def normalizer(mask: Tensor, max_length: int | None) -> float:
        return float(mask.sum().clamp(min=1))


class LossTerms(NamedTuple):
    """The per-token inputs of a micro-batch's loss besides its log-probs, each an (N, T) tensor or
    ``None``, none with a gradient: the clip bounds ``1 - epsilon`` / ``1 + epsilon_high`` per token
    (``None``: the settings' ``epsilon`` / ``epsilon_high``) and the coefficient of a k3 KL term to
    the reference policy per token, added to the token terms before the aggregation (``None``: none;
    needs ``ref_logp``), both a token-entropy rule's (``grpo.algorithm.entropy.TokenRule.loss_terms``); and
    the importance weights of the policy-gradient term (the engine's truncated IS weights,
    ``grpo.training.passes.PolicyPasses.engine_gap``; ``None``: 1)."""

    epsilon: Tensor | None = None
    epsilon_high: Tensor | None = None
    kl_weights: Tensor | None = None
    token_weights: Tensor | None = None


NO_TERMS = LossTerms()
"""The terms of a loss without per-token inputs: the settings' clip, no further KL, weights 1."""


@dataclass(frozen=True)
class LossSettings:
    """The loss's settings fixed for a run, built once from ``train.loss`` (``build_loss``): the
    policy term (an entry of ``POLICY_LOSSES``), the aggregation (of ``AGGREGATIONS``), the ordinary
    clip range's two sides (``epsilon_high`` ``None``: ``epsilon``), the k3 KL coefficient ``beta``
    and T_max of ``dr_grpo`` (``max_length``; ``None``: each batch's T)."""

    policy: PolicyLoss = clipped
    aggregation: Aggregation = TokenMean
    epsilon: float = 0.2
    epsilon_high: float | None = None
    beta: float = 0.0
    max_length: int | None = None

    def normalizer(self, mask: Tensor) -> float:
        """The aggregation's denominator of a whole batch ((N, T) ``mask``); hand it to every
        micro-batch's ``grpo_loss`` so that gradient accumulation sums to the full-batch loss."""
        return self.aggregation.normalizer(mask, self.max_length)

    def bounds(self, terms: LossTerms) -> tuple[float | Tensor, float | Tensor]:
        """The clip range's two sides of a batch: ``terms``' per-token bounds where it has them,
        else these settings' floats."""
        high = self.epsilon if self.epsilon_high is None else self.epsilon_high
        return (self.epsilon if terms.epsilon is None else terms.epsilon,
                high if terms.epsilon_high is None else terms.epsilon_high)


def build_loss(cfg: LossConfig, max_length: int | None) -> LossSettings:
    """The ``LossSettings`` of the loss part ``cfg`` (``train.loss``): its policy term and
    aggregation by name, its clip (``LossConfig.clip``) and ``beta``; ``max_length``: T_max
    (``train.rollouts.max_new_tokens``). The one place those names become the entries."""
    epsilon, epsilon_high = cfg.clip()
    return LossSettings(POLICY_LOSSES[cfg.policy_loss], AGGREGATIONS[cfg.loss_type], epsilon, epsilon_high,
                        cfg.beta, max_length)


def grpo_loss(logp: Tensor, old_logp: Tensor, ref_logp: Tensor | None, advantages: Tensor, mask: Tensor,
              settings: LossSettings = LossSettings(), *, terms: LossTerms = NO_TERMS,
              normalizer: float | None = None) -> tuple[Tensor, dict[str, float]]:
    """The GRPO loss and its statistics: the settings' policy term, times ``terms.token_weights``,
    plus ``beta`` times the k3 KL, aggregated by the settings' aggregation.

    logp, old_logp, ref_logp: (N, T) log-probs of the sampled completion tokens under the current,
    the sampling-time and the reference policy. advantages: (N,). mask: (N, T), 1 on valid
    completion tokens. Positions where ``logp`` carries no gradient (e.g. tokens dropped by the
    entropy mask, filled with detached values) still count in the value and the normaliser, but
    contribute no gradient. ``normalizer`` overrides the aggregation denominator (micro-batching;
    default ``settings.normalizer(mask)``). ``terms``: the per-token clip bounds, KL weights (a
    further k3 KL term, added with the ``beta`` term and aggregated with the policy term: needs
    ``ref_logp``) and importance weights (``LossTerms``; no gradient flows into them).

    Returns the scalar loss and the policy loss's statistics (``clipped``: ``clip_frac``,
    ``clip_low_frac``, ``clip_high_frac``, ``ratio``) with ``kl``, token means over the mask.
    """
    aggregation, beta, kl_weights = settings.aggregation, settings.beta, terms.kl_weights
    epsilon, eps_high = settings.bounds(terms)
    mask = mask.to(logp.dtype)  # (N, T)
    adv = advantages.to(logp.dtype).unsqueeze(1)  # (N, 1)

    per_token, stats = settings.policy(logp, old_logp, adv, mask, epsilon=epsilon, epsilon_high=eps_high)  # (N, T)
    if terms.token_weights is not None:
        per_token = per_token * terms.token_weights.detach().to(per_token.dtype)
    if normalizer is None:
        normalizer = settings.normalizer(mask)
    kl = kl_term = None
    if beta != 0.0 or kl_weights is not None:
        if ref_logp is None:
            raise ValueError(f"{'beta != 0' if beta != 0.0 else 'kl_weights'} needs ref_logp")
        delta = ref_logp - logp  # (N, T)
        kl = torch.exp(delta) - delta - 1  # (N, T), k3 estimator
        coef = beta + (kl_weights.detach().to(per_token.dtype) if kl_weights is not None else 0.0)  # (N, T) or float
        kl_term = coef * kl  # (N, T)
        stats.update(term_grad_norms(aggregation, per_token, kl_term, logp, mask, normalizer))
    loss = aggregation.aggregate(per_token if kl_term is None else per_token + kl_term, mask, normalizer)
    return loss, {**stats, "kl": token_mean(kl, mask) if kl is not None else 0.0}


def policy_token_grads(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
                       settings: LossSettings = LossSettings(), *, terms: LossTerms = NO_TERMS,
                       normalizer: float | None = None) -> Tensor:
    """(N, T) |d L_policy / d logp_t|: the magnitude of the policy term's gradient (``grpo_loss``'s
    arguments, without the KL) at every valid token's log-prob, as if every token carried gradient
    (a token an entropy mask drops gets the gradient it would have had). Exact: the term is
    rebuilt on a detached copy of ``logp`` and differentiated by autograd, one elementwise backward
    over (N, T), never through the model. 0 outside ``mask``."""
    epsilon, eps_high = settings.bounds(terms)
    mask = mask.to(logp.dtype)  # (N, T)
    with torch.enable_grad():
        x = logp.detach().requires_grad_(True)  # (N, T)
        per_token, _ = settings.policy(x, old_logp.detach(), advantages.detach().to(x.dtype).unsqueeze(1), mask,
                                       epsilon=epsilon, epsilon_high=eps_high)
        if terms.token_weights is not None:
            per_token = per_token * terms.token_weights.detach().to(per_token.dtype)
        if normalizer is None:
            normalizer = settings.normalizer(mask)
        (grad,) = torch.autograd.grad(settings.aggregation.aggregate(per_token, mask, normalizer), x)
    return grad.abs() * mask  # (N, T)


def term_grad_norms(aggregation, policy_term: Tensor, kl_term: Tensor, logp: Tensor, mask: Tensor,
                    normalizer: float) -> dict[str, float]:
    """Squared norms of the policy term's and the KL term's gradients with respect to the (N, T)
    token log-probs, each aggregated as the loss is: ``policy_grad_sq``, ``kl_grad_sq``
    (``grpo.training.metrics`` shows ``kl_grad_share = sqrt(kl / policy)``). Both terms reach the LoRA
    weights through the same log-probs, so this is where their shares of the update are told
    apart without a second backward through the model; it costs two elementwise backward passes.
    Empty when ``logp`` carries no gradient (a no-grad pass)."""
    if not logp.requires_grad:
        return {}
    g_pol, g_kl = (torch.autograd.grad(aggregation.aggregate(term, mask, normalizer), logp, retain_graph=True,
                                       allow_unused=True)[0] for term in (policy_term, kl_term))
    sq = [0.0 if g is None else float(g.double().pow(2).sum()) for g in (g_pol, g_kl)]
    return {"policy_grad_sq": sq[0], "kl_grad_sq": sq[1]}
