"""Token entropy, the high-entropy mask and the token-entropy rules (``TOKEN_RULES``) on tiny hand-worked
tensors."""

from __future__ import annotations

import math

import pytest
import torch

from grpo.config import TrainConfig
from grpo.entropy import TOKEN_RULES, entropy_threshold, high_entropy_mask, token_entropy


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
    cfg = TrainConfig(entropy_top_quantile=0.2)
    threshold = TOKEN_RULES["low"].threshold(entropy[mask], cfg)
    high = TOKEN_RULES["high"].grad_mask(entropy, mask, threshold, cfg)
    low = TOKEN_RULES["low"].grad_mask(entropy, mask, threshold, cfg)
    assert torch.equal(high, high_entropy_mask(entropy, mask, 0.2))
    assert not (high & low).any()
    assert torch.equal(high | low, mask)
    assert low.sum() > 3 * high.sum()  # bottom 80% against top 20%
    assert entropy[low].max() < entropy[high].min()
    with pytest.raises(ValueError, match="train.entropy_rule: no token-entropy rule 'middle'"):
        TOKEN_RULES["middle"]


def test_rules_on_the_hand_worked_entropies():
    """Valid entropies 0.1 0.9 0.5 0.3 0.7 at ``entropy_top_quantile`` 0.4: threshold 0.58 (as above);
    ``high`` keeps 0.9 and 0.7, ``low`` the other three valid ones; both share the threshold. Their
    memory need is the fraction they keep; at quantile 1 there is no statistic and ``high`` keeps
    every valid token."""
    cfg = TrainConfig(entropy_top_quantile=0.4)
    high, low = TOKEN_RULES["high"], TOKEN_RULES["low"]
    threshold = high.threshold(ENT[MASK.bool()], cfg)
    assert threshold.item() == pytest.approx(0.58) and low.threshold(ENT[MASK.bool()], cfg) == threshold
    assert high.needs_statistic(cfg) and low.needs_statistic(cfg)
    assert high.grad_mask(ENT, MASK, threshold, cfg).tolist() == [[False, True, False, False], [False, True, False, False]]
    assert low.grad_mask(ENT, MASK, threshold, cfg).tolist() == [[True, False, True, False], [True, False, False, False]]
    assert (high.grad_fraction(cfg), low.grad_fraction(cfg)) == pytest.approx((0.4, 0.6))
    every = TrainConfig(entropy_top_quantile=1.0)
    assert not high.needs_statistic(every) and high.threshold(ENT[MASK.bool()], every) is None
    assert high.grad_mask(ENT, MASK, None, every).tolist() == MASK.bool().tolist()
    assert entropy_threshold(ENT[MASK.bool()], 1.0) is None


def test_low_rule_needs_a_quantile_below_one():
    TOKEN_RULES["low"].check(TrainConfig(entropy_top_quantile=0.5))
    with pytest.raises(ValueError, match="train.entropy_rule: low"):
        TOKEN_RULES["low"].check(TrainConfig(entropy_top_quantile=0.5).model_copy(update={"entropy_top_quantile": 1.0}))
