"""Advantages and every loss variant against hand-worked values.

The tensors below were worked through by hand (numbers in the comments); they are the same
formulas as TRL's GRPOTrainer (per-token clipped surrogate, k3 KL, ``grpo`` / ``dr_grpo`` /
``dapo`` aggregation), evaluated independently here.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.loss import group_advantages, grpo_loss, loss_normalizer

LOGP = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
OLD = torch.tensor([[-1.3, -1.8, -0.5], [-0.6, -0.9, 0.0]])
REF = torch.tensor([[-1.0, -1.5, -0.5], [-0.3, -1.0, 0.0]])
ADV = torch.tensor([1.0, -0.5])
MASK = torch.tensor([[1, 1, 1], [1, 1, 0]])
# ratios: row 0 = e^0.3 (clipped high, A > 0), e^-0.2 (inside), 1; row 1 = e^0.3 (A < 0: unclipped
# branch wins), e^-0.3 (clipped low, A < 0), padding.
# token losses: row 0 = -1.2, -0.818731, -1.0 ; row 1 = +0.674929, +0.4
ROW0, ROW1 = -1.2 - math.exp(-0.2) - 1.0, 0.5 * math.exp(0.3) + 0.4


@pytest.mark.parametrize(
    ("loss_type", "expected"),
    [
        ("grpo", (ROW0 / 3 + ROW1 / 2) / 2),  # -0.234390
        ("dapo", (ROW0 + ROW1) / 5),  # -0.388760
        ("dr_grpo", (ROW0 + ROW1) / (2 * 3)),  # -0.323967
    ],
)
def test_loss_variants(loss_type, expected):
    loss, stats = grpo_loss(LOGP, OLD, None, ADV, MASK, epsilon=0.2, loss_type=loss_type)
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_high_frac"] == pytest.approx(1 / 5)
    assert stats["clip_low_frac"] == pytest.approx(1 / 5)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    ratio_mean = (2 * math.exp(0.3) + math.exp(-0.2) + 1 + math.exp(-0.3)) / 5  # 1.051853
    assert stats["ratio"] == pytest.approx(ratio_mean, rel=1e-6)
    assert stats["kl"] == 0.0


def test_hand_numbers():
    assert (ROW0 + ROW1) / 5 == pytest.approx(-0.388760, abs=1e-6)
    assert (ROW0 / 3 + ROW1 / 2) / 2 == pytest.approx(-0.234390, abs=1e-6)


def test_dr_grpo_uses_max_length():
    loss, _ = grpo_loss(LOGP, OLD, None, ADV, MASK, loss_type="dr_grpo", max_length=10)
    assert loss.item() == pytest.approx((ROW0 + ROW1) / 20, abs=1e-6)


def test_kl_term_k3():
    # delta = ref - logp: 0.5 at (0, 1) and 0.2 at (1, 1), zero elsewhere
    k3 = (math.exp(0.5) - 1.5) + (math.exp(0.2) - 1.2)  # 0.148721 + 0.021403
    loss, stats = grpo_loss(LOGP, OLD, REF, ADV, MASK, beta=0.1, loss_type="dapo")
    assert stats["kl"] == pytest.approx(k3 / 5, rel=1e-5)
    assert loss.item() == pytest.approx((ROW0 + ROW1 + 0.1 * k3) / 5, abs=1e-6)


def test_beta_needs_reference():
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(LOGP, OLD, None, ADV, MASK, beta=0.1)


def test_epsilon_high():
    # with 1 + 0.4 the e^0.3 ratio of row 0 is no longer clipped
    loss, stats = grpo_loss(LOGP, OLD, None, ADV, MASK, epsilon=0.2, epsilon_high=0.4, loss_type="dapo")
    row0 = -math.exp(0.3) - math.exp(-0.2) - 1.0
    assert loss.item() == pytest.approx((row0 + ROW1) / 5, abs=1e-6)
    assert stats["clip_high_frac"] == 0.0


def test_gradient_is_zero_where_clipped_and_on_padding():
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = grpo_loss(logp, OLD, None, ADV, MASK, loss_type="dapo")
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0.0  # clipped high with A > 0
    assert g[1, 1] == 0.0  # clipped low with A < 0
    assert g[1, 2] == 0.0  # padding
    # unclipped: d/dlogp of -A * exp(logp - old) / n_tok
    assert g[0, 1].item() == pytest.approx(-1.0 * math.exp(-0.2) / 5, rel=1e-6)
    assert g[1, 0].item() == pytest.approx(0.5 * math.exp(0.3) / 5, rel=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_micro_batches_sum_to_full_batch(loss_type):
    full, _ = grpo_loss(LOGP, OLD, None, ADV, MASK, loss_type=loss_type)
    norm = loss_normalizer(MASK, loss_type)
    parts = [
        grpo_loss(LOGP[i : i + 1], OLD[i : i + 1], None, ADV[i : i + 1], MASK[i : i + 1], loss_type=loss_type, normalizer=norm)[0]
        for i in range(2)
    ]
    assert sum(p.item() for p in parts) == pytest.approx(full.item(), abs=1e-6)


def test_unknown_loss_type():
    with pytest.raises(ValueError, match="loss_type"):
        grpo_loss(LOGP, OLD, None, ADV, MASK, loss_type="ppo")


REWARDS = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0])


def test_group_advantages_group_scale():
    adv = group_advantages(REWARDS, 4, "group")
    # group 0: mean 0.25, unbiased std 0.5; group 1 has equal rewards -> exactly zero
    expected = [0.75 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, -0.25 / 0.5001, 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)
    assert (adv[4:] == 0).all()


def test_group_advantages_batch_scale():
    adv = group_advantages(REWARDS, 4, "batch")
    std = math.sqrt((5 * 0.375**2 + 3 * 0.625**2) / 7)  # 0.517549, std of all 8 rewards
    expected = [0.75 / (std + 1e-4), -0.25 / (std + 1e-4), -0.25 / (std + 1e-4), -0.25 / (std + 1e-4), 0, 0, 0, 0]
    assert adv.tolist() == pytest.approx(expected, rel=1e-6)


def test_group_advantages_no_scale():
    assert group_advantages(REWARDS, 4, "none").tolist() == pytest.approx([0.75, -0.25, -0.25, -0.25, 0, 0, 0, 0])


def test_group_advantages_all_equal_batch_is_zero():
    assert (group_advantages(torch.full((6,), 0.7), 3, "group") == 0).all()


def test_group_advantages_bad_shape():
    with pytest.raises(ValueError):
        group_advantages(torch.zeros(7), 4)
