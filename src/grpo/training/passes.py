"""Phases 2 and 3 of a step: the passes over the policy, without grad and with grad.

Without grad (``no_grad_pass``): the (N, C) token entropies and log-probs of a step's completions,
micro-batch by micro-batch; with the adapter disabled it gives the reference policy's log-probs
(``beta > 0``, or a token-entropy rule with a KL term: ``needs_reference``; no second model). The
sampling policy's log-probs (``mu > 1``: old_logp) need no pass of their own: the first update's
forward runs at the sampling weights, so its detached log-probs are old_logp (``Accumulated.logp``;
``GRPOTrainer.update`` keeps them for the later updates): the values a no-grad pass gives, one
forward fewer per step.

With grad (``accumulate_gradients``, one update): the entropy threshold of the whole step (the
statistic of the token-entropy rule ``train.loss.entropy_rule``, ``grpo.algorithm.entropy.TOKEN_RULES``, over every
rank's valid token entropies; for ``high``, the ``1 - entropy_top_quantile`` quantile: taken in the
one forward when there is one micro-batch, else from a no-grad pass first, which a rule without a
statistic skips), then per micro-batch (``loss_backward``): one body forward with grad (each group's
prompt once, its completions on the shared KV cache); entropy and log-prob of every completion token
without grad (chunked, fused kernel: never a full (N, C, V) fp32 tensor); the LM head with grad only
at the tokens the rule keeps (``high``: at or above the threshold; chunked as well, its gradient
written over the logits: no fp32 (K, V) tensor); ``grpo_loss`` (``train.loss.policy_loss``, with the
rule's per-token clip bounds and KL weights where it has them, aggregated by ``train.loss.loss_type``)
normalised over the whole step; the updater's backward. Micro-batching changes memory and time, not
the update: the kept tokens and the normaliser are the step's.

Tokens outside the mask carry their detached log-probs in the loss and get no gradient (value and
normaliser as in arXiv 2506.01939: the sum runs over kept tokens, divided by all valid tokens).
Where ``old_logp`` is not given (``mu = 1``, and the first of ``mu`` updates) the old policy is the
current one: old_logp is the detached current log-prob (ratio 1 in value, the usual on-policy
gradient) and no extra pass runs. With engine rollouts
each token's policy-gradient term is weighted by ``min(pi_trainer / pi_engine, cap)`` (truncated
importance sampling) when ``train.rollouts.importance_sampling_cap`` is set.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import replace
from typing import NamedTuple

import torch

from grpo.algorithm.entropy import TokenRule
from grpo.algorithm.logprobs import chunked_entropy_logprobs, completion_hidden, packed_layout, selected_logprobs
from grpo.algorithm.loss import (
    NO_TERMS,
    LossSettings,
    LossTerms,
    clip_sides,
    grpo_loss,
    policy_token_grads,
    wide_clip_band,
)
from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist
from grpo.core.types import TrainBatch
from grpo.model.lora_policy import lm_parts
from grpo.training.metrics import Sums
from grpo.training.updater import Updater


def micro_slices(n: int, micro_batches: int, group: int) -> list[slice]:
    """``micro_batches`` slices of ``n`` rows, whole groups of ``group`` each where possible (shared
    prompts); the first is the largest."""
    size = math.ceil(n / micro_batches)
    if size % group and size > group:
        size = math.ceil(size / group) * group
    return [slice(i, min(n, i + size)) for i in range(0, n, size)]


class Accumulated(NamedTuple):
    """What one update's backward (``PolicyPasses.accumulate_gradients``) leaves besides the gradients."""

    sums: Sums
    """The update's ``grpo.training.metrics.Sums``."""
    kept: torch.Tensor
    """(n, C) bool, the tokens the rule gave gradient."""
    logp: torch.Tensor
    """(n, C) float32, the detached log-probs of the targets at the weights before this update's
    optimizer step (the valid positions of ``batch.mask``; padding holds no meaning)."""


class PolicyPasses:
    """The forward (and backward) passes of one step over ``model`` (see the module docstring),
    under the token-entropy rule ``rule`` and the loss ``loss``, both built once from ``cfg.loss``
    (``grpo.algorithm.entropy.build_token_rule``, ``grpo.algorithm.loss.build_loss``) by whoever makes the trainer."""

    def __init__(self, model, cfg: TrainConfig, dist: Dist, updater: Updater, rule: TokenRule, loss: LossSettings):
        self.model, self.cfg, self.dist, self.updater = model, cfg, dist, updater
        self.rule, self.loss = rule, loss
        self.body, self.lm_head = lm_parts(model)
        self.shared_group = cfg.rollouts.group_size if cfg.passes.shared_prompt_forward else 1  # see completion_hidden
        self.device = next(model.parameters()).device
        self.packed = packed_layout(cfg.passes.forward_layout, self.device.type)  # see completion_hidden

    def valid_only(self, mask: torch.Tensor) -> torch.Tensor | None:
        """The (m, C) mask to which the no-grad head pass keeps itself in the packed layout (padding
        gets 0 and no compute, as in the body), else ``None`` (every position, as the padded body)."""
        return mask if self.packed else None

    def slices(self, n: int) -> list[slice]:
        return micro_slices(n, self.cfg.passes.micro_batches, self.cfg.rollouts.group_size)

    # ------------------------------------------------------------------ without grad
    @torch.no_grad()
    def no_grad_pass(self, batch: TrainBatch, *, adapter: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, C) entropies and (n, C) log-probs of the targets, micro-batch by micro-batch (the
        same slices as the update); ``adapter=False``: the reference policy."""
        entropies, logps = [], []
        for sl in self.slices(len(batch)):
            part = batch[sl]
            with contextlib.nullcontext() if adapter else self.model.disable_adapter():
                hidden = completion_hidden(self.body, part.input_ids, part.attention_mask, part.prompt_len,
                                           self.shared_group, self.packed)  # (m, C, H)
            entropy, logp = chunked_entropy_logprobs(hidden, self.lm_head, part.targets, self.cfg.passes.logprob_chunk,
                                                     self.cfg.passes.kernel, self.valid_only(part.mask))  # (m, C) each
            entropies.append(entropy)
            logps.append(logp)
        return torch.cat(entropies), torch.cat(logps)

    def needs_reference(self) -> bool:
        """Whether the loss has a k3 KL term to the reference policy: ``beta > 0`` or the token-entropy
        rule's own (``TokenRule.needs_reference``). Then the reference pass runs, and rows of zero
        advantage still have a gradient."""
        return bool(self.loss.beta) or self.rule.needs_reference()

    def fixed_logprobs(self, batch: TrainBatch) -> TrainBatch:
        """Phase 2: ``batch`` with ``ref_logp`` filled when the loss has a KL term
        (``needs_reference``), a new record (``batch`` is left as it is); ``old_logp`` comes from the
        first update (module docstring)."""
        if not self.needs_reference():
            return batch
        return replace(batch, ref_logp=self.no_grad_pass(batch, adapter=False)[1])

    # ------------------------------------------------------------------ step-wide numbers
    def step_threshold(self, entropy: torch.Tensor, mask: torch.Tensor) -> torch.Tensor | None:
        """The token-entropy rule's threshold of the whole step from this rank's (n, C) entropies and
        mask: the valid entropies of every rank are gathered and the rule's statistic taken over all
        of them (``None`` when the rule needs none: no gather)."""
        if not self.rule.needs_statistic():
            return None
        values = self.dist.all_gather_cat(entropy[mask.bool()].float())  # (valid tokens of the step,)
        return self.rule.threshold(values)

    def step_normalizer(self, mask: torch.Tensor) -> float:
        """The ``loss_type`` denominator of the whole step from this rank's (n, C) mask, summed over
        ranks: relies on the contract of ``grpo.algorithm.loss.AGGREGATIONS`` that every aggregation's
        normaliser is a sum over completions (``dapo``: valid tokens; ``grpo``: rows; ``dr_grpo``:
        rows x ``max_new_tokens``)."""
        local = self.loss.normalizer(mask)
        return float(self.dist.all_reduce(torch.tensor(local, dtype=torch.float64, device=self.device)))

    # ------------------------------------------------------------------ with grad
    def loss_backward(self, batch: TrainBatch, normalizer: float, threshold: torch.Tensor | None = None
                      ) -> tuple[float, dict, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Forward with grad, the token-entropy rule's mask, GRPO loss and backward of one micro-batch.

        ``normalizer``: the step-wide ``step_normalizer``; ``threshold``: the step-wide entropy
        threshold, or ``None`` when ``batch`` is the whole step (taken here then). Returns the loss
        value, its stats (with engine log-probs: the gap to the trainer's and the IS weights), the
        (m, C) token entropies, the (m, C) kept mask and the (m, C) detached log-probs of the forward."""
        cfg = self.cfg
        hidden = completion_hidden(self.body, batch.input_ids, batch.attention_mask, batch.prompt_len,
                                   self.shared_group, self.packed)  # (m, C, H)
        entropy, logp_all = chunked_entropy_logprobs(hidden.detach(), self.lm_head, batch.targets, cfg.passes.logprob_chunk,
                                                     cfg.passes.kernel, self.valid_only(batch.mask))  # (m, C) each, no grad
        if threshold is None:
            threshold = self.step_threshold(entropy, batch.mask)
        keep = self.rule.grad_mask(entropy, batch.mask, threshold)  # (m, C) bool
        terms = self.rule.loss_terms(entropy, batch.mask, threshold)  # per-token clip bounds, KL weights or None
        kept_logp = selected_logprobs(hidden[keep], self.lm_head, batch.targets[keep], cfg.passes.logprob_chunk,
                                      cfg.passes.kernel)  # (K,)
        logp = logp_all.masked_scatter(keep, kept_logp)  # (m, C), grad only where kept
        old_logp = batch.old_logp if batch.old_logp is not None else logp_all  # (m, C), no grad
        weights, engine = self.engine_gap(batch, old_logp)
        terms = terms._replace(token_weights=weights)  # (m, C) or None: the engine's importance weights
        loss, stats = grpo_loss(logp, old_logp, batch.ref_logp, batch.advantages, batch.mask, self.loss, terms=terms,
                                normalizer=normalizer)
        self.updater.backward(loss)  # on every rank equally often (ZeRO reduces in each backward)
        acted = self.rule_action(batch, logp_all, old_logp, keep, terms, normalizer)
        return loss.item(), {**stats, **engine, **acted}, entropy, keep, logp_all

    @torch.no_grad()
    def rule_action(self, batch: TrainBatch, logp: torch.Tensor, old_logp: torch.Tensor, keep: torch.Tensor,
                    terms: LossTerms, normalizer: float) -> dict[str, float]:
        """Where the token-entropy rule acted in this micro-batch, as sums over its valid tokens (the
        statistics ``grpo.training.metrics`` turns into ``kept_grad_share``, ``wide_band_frac`` and
        ``wide_band_grad_share``): ``policy_grad_abs``, the summed |d L_policy / d logp_t| of every
        valid token (``grpo.algorithm.loss.policy_token_grads``: as if every token carried gradient; ``logp``
        (m, C) the detached current log-probs, the loss's values); for a rule that drops tokens
        (``grad_fraction`` below 1, ``high``) ``kept_grad``, the part of it at the kept tokens; for a
        rule with its own clip bounds (``archer``) ``wide_tokens``, ``band_tokens`` and ``band_grad``
        (``grpo.algorithm.loss.wide_clip_band``: the tokens of the wider clip, those of them whose ratio plain
        PPO would clip and the rule does not, and their part of the gradient). In every update
        ``zero_adv_rows``, the rows with valid tokens and advantage 0 (the groups of equal rewards);
        in an update after the first (``batch.old_logp`` given; in the first the ratio is 1 and no
        clip binds) the same over the tokens where a clip can act, those of rows with a nonzero
        advantage: ``acting_tokens``, ``clipped_acting`` (those the step's clip binds,
        ``grpo.algorithm.loss.clip_sides``), ``wide_acting`` and ``band_acting``. ``terms``: the loss's (the
        rule's and the engine's weights). Observes only: the update is the same with or without it."""
        eps, eps_high = self.loss.bounds(NO_TERMS)  # the ordinary clip
        rule_eps, rule_eps_high = self.loss.bounds(terms)
        grads = policy_token_grads(logp, old_logp, batch.advantages, batch.mask, self.loss, terms=terms,
                                   normalizer=normalizer)  # (m, C)
        valid, adv = batch.mask.bool(), batch.advantages.unsqueeze(1)  # (m, C), (m, 1)
        out = {"policy_grad_abs": float(grads.sum()), "zero_adv_rows": float((valid.any(1) & (adv[:, 0] == 0)).sum())}
        if self.rule.grad_fraction() < 1:
            out["kept_grad"] = float(grads[keep].sum())
        ratio = torch.exp(logp - old_logp)  # (m, C)
        acting = valid & (adv != 0) if batch.old_logp is not None else None  # (m, C): where a clip can act
        if acting is not None:
            binds = torch.logical_or(*clip_sides(ratio, adv, rule_eps, rule_eps_high))  # (m, C)
            out.update(acting_tokens=float(acting.sum()), clipped_acting=float((binds & acting).sum()))
        if terms.epsilon is not None or terms.epsilon_high is not None:
            as_tensor = lambda x: torch.as_tensor(x, dtype=torch.float32, device=logp.device).expand_as(logp)  # noqa: E731
            wide, band = wide_clip_band(ratio, adv, batch.mask, eps, eps_high, as_tensor(rule_eps),
                                        as_tensor(rule_eps_high))  # (m, C) each
            out.update(wide_tokens=float(wide.sum()), band_tokens=float(band.sum()), band_grad=float(grads[band].sum()))
            if acting is not None:
                out.update(wide_acting=float((wide & acting).sum()), band_acting=float((band & acting).sum()))
        return out

    def engine_gap(self, batch: TrainBatch, old_logp: torch.Tensor) -> tuple[torch.Tensor | None, dict]:
        """With an engine's sampling log-probs: the (m, C) truncated importance weights (or ``None``
        when the correction is off) and the gap statistics; without: ``(None, {})``."""
        if batch.sampling_logp is None:  # the policy sampled itself
            return None, {}
        valid = batch.mask.bool()
        gap = (old_logp - batch.sampling_logp).abs()[valid]  # (n_valid,)
        stats = {"mismatch_sum": float(gap.sum()), "mismatch_max": float(gap.max()) if gap.numel() else 0.0}
        if self.cfg.rollouts.importance_sampling_cap is None:
            return None, stats
        weights = torch.exp(old_logp - batch.sampling_logp).clamp(max=self.cfg.rollouts.importance_sampling_cap)  # (m, C)
        stats["is_weight_sum"] = float(weights[valid].sum())
        return weights, stats

    def accumulate_gradients(self, batch: TrainBatch, normalizer: float) -> Accumulated:
        """Backward of one update over the whole step, micro-batch by micro-batch (gradients add
        up; no optimizer step). The threshold is the step's: from the one forward when there is one
        micro-batch, else from a no-grad pass over the rows at the current weights first, which a
        rule without a statistic skips (``TokenRule.needs_statistic``; ``archer``'s cut is per
        response, ``high`` at 1 has none). Returns the ``Accumulated`` record."""
        slices = self.slices(len(batch))
        threshold = None
        if len(slices) > 1 and self.rule.needs_statistic():
            threshold = self.step_threshold(self.no_grad_pass(batch, adapter=True)[0], batch.mask)
        sums, kept, logps = Sums(), [], []
        for sl in slices:
            loss, stats, entropy, keep, logp = self.loss_backward(batch[sl], normalizer, threshold)
            m = batch.mask[sl]
            sums.add_micro_batch({**stats, "loss": loss, "entropy": float((entropy * m).sum()),
                                  "kept": float(keep.sum())}, float(m.sum()))
            kept.append(keep)
            logps.append(logp)
        return Accumulated(sums, torch.cat(kept), torch.cat(logps))
