"""Token entropy, the high-entropy mask and the token-entropy rules (``TOKEN_RULES``) on tiny hand-worked
tensors."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithm.entropy import (
    TOKEN_RULES,
    Archer,
    ArcherOptions,
    KeepHigh,
    KeepLow,
    LossTerms,
    LowOptions,
    QuantileOptions,
    build_token_rule,
    entropy_threshold,
    high_entropy_mask,
    per_response_high,
    token_entropy,
)
from grpo.config.sections.train_parts import LossConfig


def _at(quantile: float, rule: str = "high") -> LossConfig:
    """The loss part under ``rule`` with every rule's ``top_quantile`` at ``quantile``."""
    return LossConfig(entropy_rule=rule, entropy_rule_options={name: {"top_quantile": quantile} for name in TOKEN_RULES
                                                               if quantile < 1 or name != "archer"})


def test_entropy_uniform_and_peaked():
    logits = torch.stack([torch.zeros(8), torch.tensor([100.0] + [0.0] * 7)])  # (2, 8)
    ent = token_entropy(logits)
    assert ent[0].item() == pytest.approx(math.log(8), rel=1e-6)
    assert ent[1].item() == pytest.approx(0.0, abs=1e-6)


def test_entropy_two_way():
    # p = (0.75, 0.25): H = -(0.75 ln 0.75 + 0.25 ln 0.25) = 0.562335
    logits = torch.log(torch.tensor([[0.75, 0.25]]))
    assert token_entropy(logits).item() == pytest.approx(0.562335, rel=1e-5)


def test_entropy_bf16_input_is_computed_in_fp32():
    logits = torch.zeros(3, 5, dtype=torch.bfloat16)
    ent = token_entropy(logits)
    assert ent.dtype == torch.float32
    assert ent.shape == (3,)


ENT = torch.tensor([[0.1, 0.9, 0.5, 9.0], [0.3, 0.7, 9.0, 9.0]])
MASK = torch.tensor([[1, 1, 1, 0], [1, 1, 0, 0]])  # the 9.0s sit on padding / prompt positions


def test_mask_keeps_top_fraction_of_valid_tokens():
    # valid entropies: 0.1 0.9 0.5 0.3 0.7 -> the 0.6 quantile (linear) is 0.58 -> keep 0.9, 0.7
    keep = high_entropy_mask(ENT, MASK, 0.4)
    assert keep.tolist() == [[False, True, False, False], [False, True, False, False]]


def test_mask_never_keeps_padding():
    keep = high_entropy_mask(ENT, MASK, 0.2)
    assert keep.tolist() == [[False, True, False, False], [False, False, False, False]]
    assert not (keep & ~MASK.bool()).any()


def test_mask_quantile_one_keeps_all_valid():
    assert high_entropy_mask(ENT, MASK, 1.0).tolist() == MASK.bool().tolist()


def test_mask_default_fraction_on_random_entropies():
    torch.manual_seed(0)
    ent = torch.rand(16, 64)
    mask = torch.ones(16, 64)
    mask[:, 50:] = 0
    keep = high_entropy_mask(ent, mask, 0.2)
    frac = keep.sum().item() / mask.sum().item()
    assert frac == pytest.approx(0.2, abs=0.01)
    assert ent[keep].min() >= ent[mask.bool() & ~keep].max()


def test_mask_empty_and_bad_quantile():
    assert not high_entropy_mask(ENT, torch.zeros_like(MASK), 0.2).any()
    for q in (0.0, 1.5, -0.1):
        with pytest.raises(ValueError):
            high_entropy_mask(ENT, MASK, q)


def test_low_side_is_the_complement_of_the_top_within_the_valid_tokens():
    torch.manual_seed(0)
    entropy = torch.rand(4, 9)
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[1, 6:] = False
    high, low = build_token_rule(_at(0.2)), build_token_rule(_at(0.2, "low"))
    threshold = low.threshold(entropy[mask])
    keep_high, keep_low = high.grad_mask(entropy, mask, threshold), low.grad_mask(entropy, mask, threshold)
    assert torch.equal(keep_high, high_entropy_mask(entropy, mask, 0.2))
    assert not (keep_high & keep_low).any()
    assert torch.equal(keep_high | keep_low, mask)
    assert keep_low.sum() > 3 * keep_high.sum()  # bottom 80% against top 20%
    assert entropy[keep_low].max() < entropy[keep_high].min()
    with pytest.raises(ValueError, match="train.loss.entropy_rule: no token-entropy rule 'middle'"):
        TOKEN_RULES["middle"]


def test_a_rule_built_from_its_options_acts_on_tensors_without_any_config():
    """A rule is an object of its own typed options (and the ordinary clip, for ``archer``): no
    params, no loss part; its methods take tensors only. Built by hand, it acts as the one
    ``build_token_rule`` makes from the params of the same values."""
    high = KeepHigh(QuantileOptions(top_quantile=0.4))
    threshold = high.threshold(ENT[MASK.bool()])
    assert threshold.item() == pytest.approx(0.58) and high.needs_statistic() and high.grad_fraction() == 0.4
    assert high.grad_mask(ENT, MASK, threshold).tolist() == [[False, True, False, False], [False, True, False, False]]
    assert not high.needs_reference() and high.loss_terms(ENT, MASK, threshold) == LossTerms()
    archer = Archer(ArcherOptions(clip_high=0.6), clip=(0.2, 0.28))
    terms = archer.loss_terms(ENT5, MASK5, None)
    built = build_token_rule(LossConfig(**{"entropy_rule": "archer", "entropy_rule_options": {"archer": {"clip_high": 0.6}},
                                           "policy_loss_options": {"clipped": {"epsilon_high": 0.28}}}))
    for got, want in zip(terms, built.loss_terms(ENT5, MASK5, None)):
        assert (got is None and want is None) or torch.equal(got, want)
    assert terms.epsilon_high.max().item() == pytest.approx(0.6) and terms.epsilon_high.min().item() == pytest.approx(0.28)
    assert KeepHigh().options == QuantileOptions()  # no options given: the model's defaults
    with pytest.raises(ValueError, match="train.loss.entropy_rule_options.low.top_quantile: low keeps"):
        KeepLow(LowOptions(top_quantile=1.0))  # the constructor runs the rule's check


def test_rules_on_the_hand_worked_entropies():
    """Valid entropies 0.1 0.9 0.5 0.3 0.7 at ``top_quantile`` 0.4: threshold 0.58 (as above);
    ``high`` keeps 0.9 and 0.7, ``low`` the other three valid ones; both share the threshold. Their
    memory need is the fraction they keep; at quantile 1 there is no statistic and ``high`` keeps
    every valid token."""
    high, low = build_token_rule(_at(0.4)), build_token_rule(_at(0.4, "low"))
    threshold = high.threshold(ENT[MASK.bool()])
    assert threshold.item() == pytest.approx(0.58) and low.threshold(ENT[MASK.bool()]) == threshold
    assert high.needs_statistic() and low.needs_statistic()
    assert high.grad_mask(ENT, MASK, threshold).tolist() == [[False, True, False, False], [False, True, False, False]]
    assert low.grad_mask(ENT, MASK, threshold).tolist() == [[True, False, True, False], [True, False, False, False]]
    assert (high.grad_fraction(), low.grad_fraction()) == pytest.approx((0.4, 0.6))
    every = build_token_rule(LossConfig(**{"entropy_rule": "high", "entropy_rule_options": {"high": {"top_quantile": 1.0}}}))
    assert not every.needs_statistic() and every.threshold(ENT[MASK.bool()]) is None
    assert every.grad_mask(ENT, MASK, None).tolist() == MASK.bool().tolist()
    assert entropy_threshold(ENT[MASK.bool()], 1.0) is None


def test_low_rule_needs_a_quantile_below_one():
    TOKEN_RULES["low"].check(LowOptions(top_quantile=0.5))
    with pytest.raises(ValueError, match="train.loss.entropy_rule_options.low.top_quantile: low keeps"):
        TOKEN_RULES["low"].check(LowOptions(top_quantile=1.0))
    with pytest.raises(ValueError, match="train.loss.entropy_rule_options.low.top_quantile: low keeps"):
        _at(1.0, "low")  # the params' validation runs the chosen rule's check


# Two responses of 4 and 3 valid tokens (9.0: padding) for the rules that keep every token.
ENT5 = torch.tensor([[0.1, 0.5, 0.9, 0.3, 9.0], [0.2, 0.35, 0.25, 9.0, 9.0]])
MASK5 = torch.tensor([[1, 1, 1, 1, 0], [1, 1, 1, 0, 0]])


def test_archer_on_hand_worked_entropies():
    """``archer`` at ``top_quantile`` 0.2 cuts each response at its own 0.8 quantile: row 0
    sorted 0.1 0.3 0.5 0.9, position 0.8 x 3 = 2.4 -> 0.5 + 0.4 x 0.4 = 0.66, above it 0.9; row 1
    sorted 0.2 0.25 0.35, position 1.6 -> 0.25 + 0.6 x 0.1 = 0.31, above it 0.35 (the step-wide
    threshold, 0.47 below, would give row 1 no high token). High tokens clip at 1 -+ 0.5, the
    others at 1 - epsilon / 1 + epsilon_high (0.2 / 0.2, or 0.2 / 0.28 with clip-higher); the valid
    low ones carry the KL weight 0.001, the high ones and the padding none. Every valid token gets
    gradient, no statistic, the reference pass; KL 0 needs no reference and gives no weights."""
    cfg = LossConfig(**{"entropy_rule": "archer"})
    archer = build_token_rule(cfg)
    opts = cfg.rule_options("archer")
    assert (opts.top_quantile, opts.clip_high, opts.kl_low) == (0.2, 0.5, 0.001) and archer.options == opts
    high = torch.tensor([[False, False, True, False, False], [False, True, False, False, False]])
    assert torch.equal(per_response_high(ENT5, MASK5, 0.2), high)
    assert not archer.needs_statistic() and archer.threshold(ENT5[MASK5.bool()]) is None
    assert torch.equal(archer.grad_mask(ENT5, MASK5, None), MASK5.bool()) and archer.grad_fraction() == 1.0
    assert archer.needs_reference()
    terms = archer.loss_terms(ENT5, MASK5, None)
    bounds = torch.tensor([[0.2, 0.2, 0.5, 0.2, 0.2], [0.2, 0.5, 0.2, 0.2, 0.2]])
    torch.testing.assert_close(terms.epsilon, bounds, rtol=0, atol=0)
    torch.testing.assert_close(terms.epsilon_high, bounds, rtol=0, atol=0)
    torch.testing.assert_close(terms.kl_weights, 0.001 * torch.tensor([[1.0, 1, 0, 1, 0], [1, 0, 1, 0, 0]]))
    clip_higher = build_token_rule(LossConfig(**{"entropy_rule": "archer", "policy_loss_options": {"clipped": {"epsilon_high": 0.28}}}))
    clip_higher = clip_higher.loss_terms(ENT5, MASK5, None)
    torch.testing.assert_close(clip_higher.epsilon, bounds, rtol=0, atol=0)
    torch.testing.assert_close(clip_higher.epsilon_high,
                               torch.tensor([[0.28, 0.28, 0.5, 0.28, 0.28], [0.28, 0.5, 0.28, 0.28, 0.28]]))
    no_kl = build_token_rule(LossConfig(**{"entropy_rule": "archer", "entropy_rule_options": {"archer": {"kl_low": 0.0}}}))
    assert not no_kl.needs_reference() and no_kl.loss_terms(ENT5, MASK5, None).kl_weights is None
    assert torch.equal(per_response_high(ENT5, MASK5, 1.0), MASK5.bool())  # the top 100%: every valid token


def test_sent_kl_on_hand_worked_entropies():
    """``sent_kl`` at 0.2: the step's threshold over the 7 valid entropies (sorted 0.1 0.2 0.25 0.3 0.35
    0.5 0.9, position 0.8 x 6 = 4.8 -> 0.35 + 0.8 x 0.15 = 0.47), the tokens below it (five) carry
    the KL weight 0.001; the clip bounds are the params' (none given); every valid token gets gradient."""
    sent = build_token_rule(LossConfig(**{"entropy_rule": "sent_kl"}))
    threshold = sent.threshold(ENT5[MASK5.bool()])
    assert sent.needs_statistic() and threshold.item() == pytest.approx(0.47)
    assert torch.equal(sent.grad_mask(ENT5, MASK5, threshold), MASK5.bool()) and sent.grad_fraction() == 1.0
    assert sent.needs_reference()
    terms = sent.loss_terms(ENT5, MASK5, threshold)
    assert terms.epsilon is None and terms.epsilon_high is None
    torch.testing.assert_close(terms.kl_weights, 0.001 * torch.tensor([[1.0, 0, 0, 1, 0], [1, 1, 1, 0, 0]]))
    no_kl = build_token_rule(LossConfig(**{"entropy_rule": "sent_kl", "entropy_rule_options": {"sent_kl": {"kl_low": 0.0}}}))
    assert not no_kl.needs_reference() and no_kl.loss_terms(ENT5, MASK5, threshold).kl_weights is None


def test_archer_needs_a_quantile_below_one():
    with pytest.raises(ValueError, match=r"train.loss.entropy_rule_options.archer.top_quantile: archer .* set it below 1"):
        LossConfig(**{"entropy_rule": "archer", "entropy_rule_options": {"archer": {"top_quantile": 1.0}}})


def test_sent_kl_at_quantile_one_is_every_token_without_a_kl():
    """``sent_kl`` at ``top_quantile`` 1 has no low class: no threshold, no KL weights, no
    reference pass; the same gradient mask, fraction and loss terms as ``high`` at 1."""
    sent, high = build_token_rule(_at(1.0, "sent_kl")), build_token_rule(_at(1.0))
    threshold = sent.threshold(ENT5[MASK5.bool()])
    assert threshold is None and not sent.needs_statistic() and not sent.needs_reference()
    assert torch.equal(sent.grad_mask(ENT5, MASK5, threshold), high.grad_mask(ENT5, MASK5, None))
    assert sent.grad_fraction() == high.grad_fraction() == 1.0
    assert sent.loss_terms(ENT5, MASK5, threshold) == high.loss_terms(ENT5, MASK5, None)


def test_high_and_low_leave_the_loss_as_the_params_set_it():
    for name in ("high", "low"):
        rule = build_token_rule(LossConfig(**{"entropy_rule": name}))
        assert not rule.needs_reference()
        assert rule.loss_terms(ENT5, MASK5, torch.tensor(0.47)) == LossTerms()
