"""Token entropy and the token-entropy rules: pure tensor functions.

``train.entropy_rule`` names a rule of ``TOKEN_RULES``: how a step treats its completion tokens by
their predictive entropy. The rules here follow "Beyond the 80/20 Rule" (arXiv 2506.01939): only
the ``top_quantile`` fraction of valid completion tokens with the highest entropy ("forking
tokens") receive policy gradient (``high``), or, as that paper's contrast, only the others
(``low``). The threshold is the ``1 - top_quantile`` quantile of the entropies of all valid
completion tokens in the batch (linear interpolation, as ``torch.quantile``); ``high`` keeps the
tokens at or above it, ``low`` those below. Padding and prompt tokens are never kept. Ties at the
threshold are all kept by ``high``, so its kept fraction can exceed ``top_quantile`` slightly.

"The batch" is the whole optimizer step: a trainer that splits the step into micro-batches (or
over processes) takes the rule's ``threshold`` once over all of the step's valid tokens and
passes it to the rule's ``grad_mask`` for every part, so the split changes memory, not the
tokens that learn.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from grpo.registry import Registry


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, in fp32: (..., V) -> (...)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (..., 1)
    probs = torch.exp(logits - lse)  # (..., V)
    return lse.squeeze(-1) - (probs * logits).sum(-1)


def entropy_threshold(values: Tensor, top_quantile: float) -> Tensor | None:
    """The ``1 - top_quantile`` quantile of ``values`` (1-D: the entropies of all valid tokens of
    the step), or ``None`` (keep every valid token) when ``top_quantile >= 1`` or there are none."""
    if not 0 < top_quantile <= 1:
        raise ValueError(f"top_quantile must be in (0, 1], got {top_quantile}")
    if top_quantile >= 1 or values.numel() == 0:
        return None
    return torch.quantile(values.float(), 1.0 - top_quantile)


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float, threshold: Tensor | None = None) -> Tensor:
    """Boolean mask of the highest-entropy valid tokens.

    entropy: (N, T); mask: (N, T), true/1 on valid completion tokens. Returns a (N, T) bool tensor
    that is a subset of ``mask``. ``top_quantile = 1`` keeps every valid token. ``threshold``: the
    step-wide value from ``entropy_threshold`` when these rows are part of a larger step; by
    default it is taken over the valid tokens given here.
    """
    if threshold is None:
        threshold = entropy_threshold(entropy[mask.bool()], top_quantile)
    return KeepHigh.grad_mask(entropy, mask, threshold, None)


class TokenRule:
    """An entry of ``TOKEN_RULES``: what a step does with its tokens by their entropy. Entries are
    classes of static methods (never instantiated); ``cfg`` is the ``grpo.config.TrainConfig``,
    from which a rule reads its own params (``entropy_top_quantile`` here). The defaults keep every
    valid token and need no statistic.

    - ``check(cfg)``: raise ``ValueError`` (one line naming the param) when the params do not
      suit the rule; ``TrainConfig`` calls it when the section is built.
    - ``needs_statistic(cfg)``: whether ``threshold`` needs the step's entropies (the passes
      gather every rank's valid entropies only then).
    - ``threshold(values, cfg)``: the step-wide statistic from the 1-D entropies of every valid
      token of the step (all micro-batches and ranks), or ``None``.
    - ``grad_mask(entropy, mask, threshold, cfg)``: the (N, T) bool mask, a subset of ``mask``, of
      the tokens whose policy term carries gradient (the LM head runs with grad at those only);
      the others keep their detached log-probs in the loss value and the normaliser.
    - ``grad_fraction(cfg)``: the fraction of valid tokens ``grad_mask`` keeps, for the memory
      estimate (``grpo.memory``: the LM-head rows with grad).

    A rule that treats tokens by entropy without discarding any (entropy-dependent clip bounds
    after Archer, arXiv 2507.15778; a KL term on the low-entropy tokens after SENT, arXiv
    2512.04359) keeps the defaults of ``grad_mask`` and ``grad_fraction`` and adds one hook that
    ``grpo.passes.PolicyPasses.loss_backward`` passes to ``grpo.loss.grpo_loss``: per-token clip
    bounds, ``(N, T)`` tensors given as ``epsilon`` / ``epsilon_high`` (the ``clipped`` policy loss
    takes tensors there), or an extra ``(N, T)`` per-token loss term added before the aggregation.
    That hook is not written yet: the first such rule adds it, with its test.
    """

    @staticmethod
    def check(cfg: Any) -> None:
        return None

    @staticmethod
    def needs_statistic(cfg: Any) -> bool:
        return False

    @staticmethod
    def threshold(values: Tensor, cfg: Any) -> Tensor | None:
        return None

    @staticmethod
    def grad_mask(entropy: Tensor, mask: Tensor, threshold: Tensor | None, cfg: Any) -> Tensor:
        return mask.bool().clone()

    @staticmethod
    def grad_fraction(cfg: Any) -> float:
        return 1.0


TOKEN_RULES: Registry[type[TokenRule]] = Registry("train.entropy_rule", "token-entropy rule")
"""Rule name -> ``TokenRule`` subclass (``train.entropy_rule``)."""


class QuantileRule(TokenRule):
    """The rules of one threshold: the ``1 - entropy_top_quantile`` quantile of the step's valid
    entropies (none at ``entropy_top_quantile`` 1)."""

    @staticmethod
    def needs_statistic(cfg: Any) -> bool:
        return cfg.entropy_top_quantile < 1

    @staticmethod
    def threshold(values: Tensor, cfg: Any) -> Tensor | None:
        return entropy_threshold(values, cfg.entropy_top_quantile)


@TOKEN_RULES.register("high")
class KeepHigh(QuantileRule):
    """The top ``entropy_top_quantile`` of the valid tokens by entropy (at or above the threshold)
    get policy gradient; ``entropy_top_quantile`` 1: every valid token."""

    @staticmethod
    def grad_mask(entropy: Tensor, mask: Tensor, threshold: Tensor | None, cfg: Any) -> Tensor:
        valid = mask.bool()
        return valid.clone() if threshold is None else (entropy >= threshold) & valid

    @staticmethod
    def grad_fraction(cfg: Any) -> float:
        return cfg.entropy_top_quantile


@TOKEN_RULES.register("low")
class KeepLow(QuantileRule):
    """The valid tokens below the threshold get policy gradient: the complement of ``high`` within
    the valid tokens (the bottom ``1 - entropy_top_quantile``)."""

    @staticmethod
    def check(cfg: Any) -> None:
        if cfg.entropy_top_quantile >= 1:
            raise ValueError("train.entropy_rule: low keeps the tokens below the top entropy_top_quantile; "
                             "set train.entropy_top_quantile below 1")

    @staticmethod
    def grad_mask(entropy: Tensor, mask: Tensor, threshold: Tensor | None, cfg: Any) -> Tensor:
        valid = mask.bool()
        return valid.clone() if threshold is None else (entropy < threshold) & valid

    @staticmethod
    def grad_fraction(cfg: Any) -> float:
        return 1 - cfg.entropy_top_quantile
