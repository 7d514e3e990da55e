"""Token entropy and the token-entropy rules: pure tensor functions.

``train.loss.entropy_rule`` names a rule of ``TOKEN_RULES``: how a step treats its completion tokens by
their predictive entropy H_t. Two rules follow "Beyond the 80/20 Rule" (arXiv 2506.01939): only
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

Two rules discard no token (every valid token gets policy gradient) and treat the classes
differently in the loss (``TokenRule.loss_terms``). With q = ``top_quantile`` (0.2),
rho_t the ratio, k3_t = exp(ref_t - logp_t) - (ref_t - logp_t) - 1 against the reference policy
(the adapter disabled), c = the rule's ``kl_low`` (0.001; ``train.loss.entropy_rule_options.<rule>``):

* ``archer`` (Archer, arXiv 2507.15778; code github.com/wizard-III/ArcherCodeR @ 8a1785be):
  tau_i = the ``1 - q`` quantile of response i's valid entropies (``torch.nanquantile`` along
  the row); high_t = H_t > tau_i (ties low). Clip range per token: archer's ``clip_high`` (0.5) on
  both sides for high tokens, ``epsilon`` / ``epsilon_high`` (0.2 / 0.2) for low ones; loss term
  ``clipped(rho_t, eps_t) + c * k3_t * low_t``. Code values: quantile 0.8 per response, clip 0.2 /
  0.5, KL coefficient 0.001 on low tokens and 0 on high ones (``core_algos.py:597-604``,
  ``dp_actor.py:397-449``, ``run_archer_qwen2.5_1.5b_code.sh:15, 62-67``). Departures: the KL goes
  through ``train.loss.loss_type``'s aggregation, whose denominator counts every valid token (``dapo``)
  or every response's (``grpo``), not Archer's count of low tokens, so its weight is c times the
  low fraction (about 0.8c; set c / 0.8 to match); the cut is per response like Archer's code,
  unlike ``high`` / ``sent_kl``'s step-wide threshold; Archer's dual clip (-A * 10 bounds the term
  for A < 0, ``core_algos.py:607-612``) and its clamps of log rho and k3 are not implemented.
* ``sent_kl`` (SENT, arXiv 2512.04359; code github.com/zldscr0/SENT @ 2a7c40fa): low_t = H_t below
  the step-wide threshold of ``high`` (the bottom ``1 - q``, 0.8 as the code's); loss term
  ``clipped(rho_t, epsilon) + c * k3_t * low_t``. The paper's idea (KL to pi_ref on low-entropy
  tokens); its selection of the high-covariance ones among them is not implemented: the paper's
  fraction and coefficient could not be read, and the released code's selection indexes rows with
  an integer mask (``core_algos.py:880-881``), so it penalises |log rho| against the old policy on
  about 2 arbitrary tokens per micro-batch, unclipped (``core_algos.py:844-904``).

Both need the reference pass even at ``train.loss.beta`` 0 (``needs_reference``; ``c = 0`` drops the KL
and the pass, and so does ``sent_kl`` at q = 1, where it has no low class and is ``high`` at 1) and
keep the groups of equal rewards in the update (their KL has a gradient). Since every token keeps
its gradient, the LM head runs with grad at every valid token: its rows of logits with grad
(``grpo.tools.memory``'s "LM head with grad") are 1/q = 5 times ``high``'s, whose kept-token pass holds q
of them. The sources line by line: docs/design.md#token-entropy-rules.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Annotated, ClassVar

import torch
from pydantic import Field
from torch import Tensor

from grpo.algorithm.loss import LossTerms
from grpo.core.fields import Fraction, PositiveFloat, Section
from grpo.core.registry import Registry

if TYPE_CHECKING:
    from grpo.config.sections.train_parts import LossConfig


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


def at_or_above(entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> Tensor:
    """(N, T) bool: the valid tokens of ``mask`` (N, T) whose ``entropy`` (N, T) is at or above
    ``threshold``; every valid token when it is ``None``."""
    valid = mask.bool()
    return valid.clone() if threshold is None else (entropy >= threshold) & valid


def below(entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> Tensor:
    """(N, T) bool: the valid tokens below ``threshold`` (the complement of ``at_or_above`` within
    ``mask``); every valid token when it is ``None``."""
    valid = mask.bool()
    return valid.clone() if threshold is None else (entropy < threshold) & valid


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float, threshold: Tensor | None = None) -> Tensor:
    """Boolean mask of the highest-entropy valid tokens.

    entropy: (N, T); mask: (N, T), true/1 on valid completion tokens. Returns a (N, T) bool tensor
    that is a subset of ``mask``. ``top_quantile = 1`` keeps every valid token. ``threshold``: the
    step-wide value from ``entropy_threshold`` when these rows are part of a larger step; by
    default it is taken over the valid tokens given here.
    """
    if threshold is None:
        threshold = entropy_threshold(entropy[mask.bool()], top_quantile)
    return at_or_above(entropy, mask, threshold)


class TokenRule:
    """An entry of ``TOKEN_RULES``: what a step does with its tokens by their entropy. A rule is an
    object built once per run from its own typed options (``Options``, a ``grpo.config.reading.Section``
    under ``train.loss.entropy_rule_options.<name>``; ``build_token_rule`` is the one place that
    turns the param's name into the object) and the ordinary clip range ``clip`` =
    ``(epsilon, epsilon_high)``, for a rule that modifies it; its methods then take tensors only.
    The defaults keep every valid token, need no statistic and leave the loss as the params set it.

    - ``check(options)`` (a class method): raise ``ValueError`` (one line naming the param) when the
      options do not suit the rule; ``LossConfig`` calls it when the part is built, and so does the
      constructor.
    - ``needs_statistic()``: whether ``threshold`` needs the step's entropies (the passes gather
      every rank's valid entropies only then).
    - ``threshold(values)``: the step-wide statistic from the 1-D entropies of every valid token of
      the step (all micro-batches and ranks), or ``None``.
    - ``grad_mask(entropy, mask, threshold)``: the (N, T) bool mask, a subset of ``mask``, of the
      tokens whose policy term carries gradient (the LM head runs with grad at those only); the
      others keep their detached log-probs in the loss value and the normaliser.
    - ``grad_fraction()``: the fraction of valid tokens ``grad_mask`` keeps, for the memory estimate
      (``grpo.tools.memory``: the LM-head rows with grad).
    - ``needs_reference()``: whether ``loss_terms`` gives KL weights, so that the passes compute the
      reference log-probs even at ``train.loss.beta`` 0 (and the trainer keeps the groups of equal
      rewards, whose KL term has a gradient).
    - ``loss_terms(entropy, mask, threshold)``: the ``grpo.algorithm.loss.LossTerms`` of a micro-batch
      (per-token clip bounds, per-token KL weights), from the same arguments as ``grad_mask``.
    """

    Options: ClassVar[type[Section] | None] = None
    """The rule's options model (``None``: a rule without options)."""

    def __init__(self, options: Section | None = None, *, clip: tuple[float, float] | None = None):
        """``options``: an ``Options`` (``None``: its defaults); ``clip``: the ordinary clip's two
        sides, kept for a rule that modifies them (``None`` where none does)."""
        if options is None and self.Options is not None:
            options = self.Options()
        self.check(options)
        self.options, self.clip = options, clip

    @classmethod
    def check(cls, options: Section | None) -> None:
        return None

    def needs_statistic(self) -> bool:
        return False

    def threshold(self, values: Tensor) -> Tensor | None:
        return None

    def grad_mask(self, entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> Tensor:
        return mask.bool().clone()

    def grad_fraction(self) -> float:
        return 1.0

    def needs_reference(self) -> bool:
        return False

    def loss_terms(self, entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> LossTerms:
        return LossTerms()


TOKEN_RULES: Registry[type[TokenRule]] = Registry("train.loss.entropy_rule", "token-entropy rule")
"""Rule name -> ``TokenRule`` subclass (``train.loss.entropy_rule``)."""


def build_token_rule(cfg: LossConfig) -> TokenRule:
    """The token rule ``cfg.entropy_rule`` of the loss part ``cfg`` (``train.loss``), built from its
    options (``train.loss.entropy_rule_options.<name>``; none for a rule that declares none) and the
    ordinary clip (``LossConfig.clip``): the one place the rule's name becomes the object."""
    return TOKEN_RULES[cfg.entropy_rule](cfg.rule_options(), clip=cfg.clip())


class QuantileOptions(Section):
    """``train.loss.entropy_rule_options.high``: the rule's share of high-entropy tokens."""

    SECTION: ClassVar[str] = "train.loss.entropy_rule_options.high"
    top_quantile: Fraction = 1.0
    """The fraction q of the step's valid completion tokens, by highest entropy, that the rule
    counts as high-entropy (1.0, the default: every token, no entropy treatment; the masking
    paper's 0.2: its forking tokens only)."""


class LowOptions(QuantileOptions):
    """``train.loss.entropy_rule_options.low``."""

    SECTION: ClassVar[str] = "train.loss.entropy_rule_options.low"
    top_quantile: Fraction = 0.2
    """The share q by highest entropy that ``low`` leaves out (below 1: it keeps the others)."""


class SentKLOptions(QuantileOptions):
    """``train.loss.entropy_rule_options.sent_kl``."""

    SECTION: ClassVar[str] = "train.loss.entropy_rule_options.sent_kl"
    top_quantile: Fraction = 0.2
    """The share q by highest entropy free of the KL; the tokens below the threshold get it."""
    kl_low: Annotated[float, Field(ge=0)] = 0.001
    """The coefficient c of the k3 KL to the reference policy on the low-entropy tokens, which needs
    the reference pass even at ``train.loss.beta`` 0 (0: no KL, no pass)."""


class ArcherOptions(SentKLOptions):
    """``train.loss.entropy_rule_options.archer``."""

    SECTION: ClassVar[str] = "train.loss.entropy_rule_options.archer"
    clip_high: PositiveFloat = 0.5
    """The clip range of the high-entropy tokens, ``1 - x`` to ``1 + x`` (Archer's 0.5; its
    low-entropy tokens clip at ``train.loss.policy_loss_options.clipped``'s bounds)."""


class QuantileRule(TokenRule):
    """The rules of one threshold: the ``1 - top_quantile`` quantile of the step's valid
    entropies (none at ``top_quantile`` 1)."""

    options: QuantileOptions

    def needs_statistic(self) -> bool:
        return self.options.top_quantile < 1

    def threshold(self, values: Tensor) -> Tensor | None:
        return entropy_threshold(values, self.options.top_quantile)


@TOKEN_RULES.register("high")
class KeepHigh(QuantileRule):
    """The top ``top_quantile`` of the valid tokens by entropy (at or above the threshold) get
    policy gradient; ``top_quantile`` 1: every valid token."""

    Options = QuantileOptions

    def grad_mask(self, entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> Tensor:
        return at_or_above(entropy, mask, threshold)

    def grad_fraction(self) -> float:
        return self.options.top_quantile


@TOKEN_RULES.register("low")
class KeepLow(QuantileRule):
    """The valid tokens below the threshold get policy gradient: the complement of ``high`` within
    the valid tokens (the bottom ``1 - top_quantile``)."""

    Options = LowOptions

    @classmethod
    def check(cls, options: LowOptions) -> None:
        if options.top_quantile >= 1:
            raise ValueError("train.loss.entropy_rule_options.low.top_quantile: low keeps the tokens below the top "
                             "top_quantile; set it below 1")

    def grad_mask(self, entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> Tensor:
        return below(entropy, mask, threshold)

    def grad_fraction(self) -> float:
        return 1 - self.options.top_quantile


def per_response_high(entropy: Tensor, mask: Tensor, top_quantile: float) -> Tensor:
    """(N, T) bool: the valid tokens above their own row's ``1 - top_quantile`` quantile of the
    valid entropies (linear interpolation; ties below), as Archer's ``torch.nanquantile`` along each
    response; ``top_quantile`` 1: every valid token. A row without valid tokens has none."""
    valid = mask.bool()
    if top_quantile >= 1:
        return valid.clone()
    values = entropy.float().masked_fill(~valid, float("nan"))  # (N, T)
    tau = torch.nanquantile(values, 1.0 - top_quantile, dim=-1, keepdim=True)  # (N, 1), NaN for an empty row
    return (entropy > tau) & valid


def low_kl_weights(low: Tensor, kl_low: float) -> Tensor | None:
    """(N, T) ``kl_low`` on the tokens of ``low`` (bool), 0 elsewhere; ``None`` at 0."""
    return low.float() * kl_low if kl_low > 0 else None


@TOKEN_RULES.register("archer")
class Archer(TokenRule):
    """Every valid token gets gradient; per response, the tokens above its ``1 - top_quantile``
    entropy quantile clip at ``1 -+ clip_high``, the others at the ordinary ``clip`` (``1 -
    epsilon`` / ``1 + epsilon_high``) and add ``kl_low`` x k3 to the reference (arXiv 2507.15778;
    see the module docstring)."""

    Options = ArcherOptions
    options: ArcherOptions

    def __init__(self, options: ArcherOptions | None = None, *, clip: tuple[float, float]):
        """``clip``: the ordinary clip's ``(epsilon, epsilon_high)``, the low-entropy tokens' bounds."""
        super().__init__(options, clip=clip)

    @classmethod
    def check(cls, options: ArcherOptions) -> None:
        if options.top_quantile >= 1:
            raise ValueError("train.loss.entropy_rule_options.archer.top_quantile: archer treats the tokens below "
                             "the top top_quantile apart; set it below 1")

    def needs_reference(self) -> bool:
        return self.options.kl_low > 0

    def loss_terms(self, entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> LossTerms:
        opts = self.options
        high = per_response_high(entropy, mask, opts.top_quantile)  # (N, T) bool
        eps, eps_high = self.clip
        wide = torch.full_like(entropy, opts.clip_high, dtype=torch.float32)  # (N, T)
        return LossTerms(epsilon=torch.where(high, wide, eps), epsilon_high=torch.where(high, wide, eps_high),
                         kl_weights=low_kl_weights(mask.bool() & ~high, opts.kl_low))


@TOKEN_RULES.register("sent_kl")
class SentKL(QuantileRule):
    """Every valid token gets gradient with the configured clip; the tokens below the step's
    threshold (the bottom ``1 - top_quantile``) add ``kl_low`` x k3 to the reference
    (after arXiv 2512.04359, without its covariance selection; see the module docstring). At
    ``top_quantile`` 1 there is no low class: no KL and no reference pass, the step of
    ``high`` at 1 (every token, no entropy treatment), so ``top_quantile: 1.0`` means
    every token under either rule."""

    Options = SentKLOptions
    options: SentKLOptions

    def needs_reference(self) -> bool:
        return self.options.kl_low > 0 and self.options.top_quantile < 1

    def loss_terms(self, entropy: Tensor, mask: Tensor, threshold: Tensor | None) -> LossTerms:
        if threshold is None:  # top_quantile 1 (or no valid token): no low class
            return LossTerms()
        return LossTerms(kl_weights=low_kl_weights(below(entropy, mask, threshold), self.options.kl_low))
