"""Advantages and every loss variant against hand-worked values, an independent reference, and
properties of the loss.

The tensors below were worked through by hand (numbers in the comments); they are the same
formulas as TRL's GRPOTrainer (per-token clipped surrogate, k3 KL, ``grpo`` / ``dr_grpo`` /
``dapo`` aggregation), evaluated independently here. ``reference_loss`` restates the loss and its
gradient token by token in plain Python and is compared with ``grpo_loss`` on random batches; the
property tests check what any correct implementation must satisfy (no gradient off the mask, clip
boundaries, linearity in the advantage scale, invariance to padding).
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo.algorithm.loss import (
    AGGREGATIONS,
    POLICY_LOSSES,
    LossSettings,
    LossTerms,
    build_loss,
    group_advantages,
    grpo_loss,
    policy_token_grads,
    wide_clip_band,
)


def S(loss_type: str = "dapo", **settings) -> LossSettings:
    """The loss settings of aggregation ``loss_type`` with ``settings`` (``epsilon``, ``beta`` ...)."""
    return LossSettings(aggregation=AGGREGATIONS[loss_type], **settings)


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
    loss, stats = grpo_loss(LOGP, OLD, None, ADV, MASK, S(loss_type, epsilon=0.2))
    assert loss.item() == pytest.approx(expected, abs=1e-6)
    assert stats["clip_high_frac"] == pytest.approx(1 / 5)
    assert stats["clip_low_frac"] == pytest.approx(1 / 5)
    assert stats["clip_frac"] == pytest.approx(2 / 5)
    ratio_mean = (2 * math.exp(0.3) + math.exp(-0.2) + 1 + math.exp(-0.3)) / 5  # 1.051853
    assert stats["ratio"] == pytest.approx(ratio_mean, rel=1e-6)
    assert stats["kl"] == 0.0


def test_dr_grpo_uses_max_length():
    loss, _ = grpo_loss(LOGP, OLD, None, ADV, MASK, S("dr_grpo", max_length=10))
    assert loss.item() == pytest.approx((ROW0 + ROW1) / 20, abs=1e-6)


def test_kl_term_k3():
    # delta = ref - logp: 0.5 at (0, 1) and 0.2 at (1, 1), zero elsewhere
    k3 = (math.exp(0.5) - 1.5) + (math.exp(0.2) - 1.2)  # 0.148721 + 0.021403
    loss, stats = grpo_loss(LOGP, OLD, REF, ADV, MASK, S("dapo", beta=0.1))
    assert stats["kl"] == pytest.approx(k3 / 5, rel=1e-5)
    assert loss.item() == pytest.approx((ROW0 + ROW1 + 0.1 * k3) / 5, abs=1e-6)


def test_beta_needs_reference():
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(LOGP, OLD, None, ADV, MASK, S(beta=0.1))


def test_epsilon_high():
    # with 1 + 0.4 the e^0.3 ratio of row 0 is no longer clipped
    loss, stats = grpo_loss(LOGP, OLD, None, ADV, MASK, S("dapo", epsilon=0.2, epsilon_high=0.4))
    row0 = -math.exp(0.3) - math.exp(-0.2) - 1.0
    assert loss.item() == pytest.approx((row0 + ROW1) / 5, abs=1e-6)
    assert stats["clip_high_frac"] == 0.0


def test_per_token_clip_bounds_equal_the_scalar_ones():
    """The ``clipped`` policy loss takes (N, T) tensors as its clip bounds (the hook of a token rule
    with entropy-dependent clipping, ``grpo.algorithm.entropy.TokenRule``): tensors filled with the scalars give
    the same loss and statistics; a looser upper bound on token (0, 0) alone unclips it."""
    scalar = grpo_loss(LOGP, OLD, None, ADV, MASK, S(epsilon=0.2, epsilon_high=0.3))
    low, high = torch.full_like(LOGP, 0.2), torch.full_like(LOGP, 0.3)
    tensor = grpo_loss(LOGP, OLD, None, ADV, MASK, terms=LossTerms(epsilon=low, epsilon_high=high))
    assert tensor[0].item() == scalar[0].item() and tensor[1] == scalar[1]
    high[0, 0] = 0.4
    loss, stats = grpo_loss(LOGP, OLD, None, ADV, MASK, terms=LossTerms(epsilon=low, epsilon_high=high))
    assert loss.item() == pytest.approx((-math.exp(0.3) - math.exp(-0.2) - 1.0 + ROW1) / 5, abs=1e-6)
    assert stats["clip_high_frac"] == 0.0


def test_gradient_is_zero_where_clipped_and_on_padding():
    logp = LOGP.clone().requires_grad_(True)
    loss, _ = grpo_loss(logp, OLD, None, ADV, MASK, S("dapo"))
    loss.backward()
    g = logp.grad
    assert g[0, 0] == 0.0  # clipped high with A > 0
    assert g[1, 1] == 0.0  # clipped low with A < 0
    assert g[1, 2] == 0.0  # padding
    # unclipped: d/dlogp of -A * exp(logp - old) / n_tok
    assert g[0, 1].item() == pytest.approx(-1.0 * math.exp(-0.2) / 5, rel=1e-6)
    assert g[1, 0].item() == pytest.approx(0.5 * math.exp(0.3) / 5, rel=1e-6)


@pytest.mark.parametrize("loss_type", AGGREGATIONS.names())
def test_micro_batches_sum_to_full_batch(loss_type):
    """The contract of every aggregation: the normaliser is a sum over the rows, and the parts'
    losses over the batch's normaliser add up to the batch's loss."""
    full, _ = grpo_loss(LOGP, OLD, None, ADV, MASK, S(loss_type))
    norm = S(loss_type).normalizer(MASK)
    assert sum(S(loss_type, max_length=MASK.shape[1]).normalizer(MASK[i : i + 1]) for i in range(2)) == norm
    parts = [
        grpo_loss(LOGP[i : i + 1], OLD[i : i + 1], None, ADV[i : i + 1], MASK[i : i + 1], S(loss_type), normalizer=norm)[0]
        for i in range(2)
    ]
    assert sum(p.item() for p in parts) == pytest.approx(full.item(), abs=1e-6)


def test_unknown_loss_type_and_policy_loss():
    """``build_loss`` turns the names into the entries: an unknown one is one line naming the param
    (the params' validation says it first; ``model_construct`` skips it here)."""
    from grpo.config.sections.train_parts import LossConfig

    with pytest.raises(ValueError, match="train.loss.loss_type: no loss aggregation 'ppo'"):
        build_loss(LossConfig.model_construct(loss_type="ppo"), None)
    with pytest.raises(ValueError, match="train.loss.policy_loss: no policy loss 'ppo'"):
        build_loss(LossConfig.model_construct(policy_loss="ppo"), None)


def test_build_loss_takes_the_params_settings():
    """The settings of a loss part: its entries by name, its clip (``epsilon_high`` null: ``epsilon``),
    ``beta`` and T_max as given."""
    from grpo.config.sections.train_parts import LossConfig

    cfg = LossConfig(loss_type="grpo", beta=0.04, policy_loss_options={"clipped": {"epsilon": 0.1, "epsilon_high": 0.28}})
    assert build_loss(cfg, 24) == LossSettings(POLICY_LOSSES["clipped"], AGGREGATIONS["grpo"], 0.1, 0.28, 0.04, 24)
    assert build_loss(LossConfig(), None).bounds(LossTerms()) == (0.2, 0.2)


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


# --- an independent reference: the per-token clipped surrogate written out case by case ----------


def reference_loss(logp, old, ref, adv, mask, *, eps, eps_high=None, beta=0.0, loss_type, max_length=None):
    """(loss, d loss / d logp) from plain Python loops over the tokens.

    The clipped surrogate by cases (PPO / GRPO): with A > 0 the term is capped once the ratio exceeds
    1 + eps_high, with A < 0 once it falls below 1 - eps; otherwise it is -rho * A. The gradient is
    written out by hand: -rho * A on unclipped tokens, 0 on clipped ones, plus beta * (1 - e^(ref - logp))
    from the k3 KL term, times the weight the aggregation gives the token.
    """
    eps_high = eps if eps_high is None else eps_high
    n, t = len(logp), len(logp[0])
    lengths = [sum(int(m) for m in row) for row in mask]
    n_tok = sum(lengths)
    total, grad = 0.0, [[0.0] * t for _ in range(n)]
    for i in range(n):
        a = adv[i]
        for j in range(t):
            if not mask[i][j]:
                continue
            rho = math.exp(logp[i][j] - old[i][j])
            if a > 0 and rho > 1 + eps_high:
                term, dterm = -(1 + eps_high) * a, 0.0
            elif a < 0 and rho < 1 - eps:
                term, dterm = -(1 - eps) * a, 0.0
            else:
                term, dterm = -rho * a, -rho * a
            if beta:
                d = ref[i][j] - logp[i][j]
                term += beta * (math.exp(d) - d - 1)
                dterm += beta * (1 - math.exp(d))
            if loss_type == "dapo":  # token mean over the batch
                weight = 1 / n_tok
            elif loss_type == "grpo":  # mean over the sequence's tokens, then over sequences
                weight = 1 / (lengths[i] * n)
            else:  # dr_grpo: sum / (N * T_max)
                weight = 1 / (n * (max_length or t))
            total += weight * term
            grad[i][j] = weight * dterm
    return total, grad


def random_batch(seed, n=5, t=7):
    """Log-probs whose ratios spread over both clip boundaries, mixed-sign advantages, ragged mask."""
    g = torch.Generator().manual_seed(seed)
    old = -torch.rand(n, t, generator=g, dtype=torch.float64) * 3
    logp = old + 0.35 * torch.randn(n, t, generator=g, dtype=torch.float64)
    ref = logp + 0.3 * torch.randn(n, t, generator=g, dtype=torch.float64)
    adv = torch.randn(n, generator=g, dtype=torch.float64)
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1  # both signs present
    lengths = torch.randint(1, t + 1, (n,), generator=g)
    lengths[0] = t
    mask = (torch.arange(t)[None, :] < lengths[:, None]).long()
    return logp, old, ref, adv, mask


@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize(("beta", "eps_high", "max_length"), [(0.0, None, None), (0.04, 0.28, None), (0.1, None, 12)])
def test_value_and_gradient_match_reference(seed, loss_type, beta, eps_high, max_length):
    logp, old, ref, adv, mask = random_batch(seed)
    rho = torch.exp(logp - old)
    valid = mask.bool()
    # the batch exercises every branch of the surrogate
    assert (valid & (rho > 1 + (eps_high or 0.2)) & (adv[:, None] > 0)).any()
    assert (valid & (rho < 0.8) & (adv[:, None] < 0)).any()
    assert (~valid).any()

    x = logp.clone().requires_grad_(True)
    loss, _ = grpo_loss(x, old, ref, adv, mask, S(loss_type, epsilon=0.2, epsilon_high=eps_high, beta=beta,
                                                  max_length=max_length))
    loss.backward()
    want, want_grad = reference_loss(logp.tolist(), old.tolist(), ref.tolist(), adv.tolist(), mask.tolist(),
                                     eps=0.2, eps_high=eps_high, beta=beta, loss_type=loss_type,
                                     max_length=max_length)
    assert loss.item() == pytest.approx(want, rel=1e-9, abs=1e-12)
    assert x.grad.flatten().tolist() == pytest.approx(sum(want_grad, []), rel=1e-9, abs=1e-12)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_no_gradient_outside_the_mask(loss_type):
    logp, old, ref, adv, mask = random_batch(3)
    x = logp.clone().requires_grad_(True)
    grpo_loss(x, old, ref, adv, mask, S(loss_type, beta=0.1))[0].backward()
    assert (x.grad[mask == 0] == 0).all()
    assert (x.grad[mask == 1] != 0).any()


def _token_grad(log_ratio, adv, eps=0.2, eps_high=None):
    """Gradient of the one-token loss with respect to logp, at the given log-ratio."""
    x = torch.tensor([[log_ratio]], dtype=torch.float64, requires_grad=True)
    old = torch.zeros(1, 1, dtype=torch.float64)
    grpo_loss(x, old, None, torch.tensor([adv], dtype=torch.float64), torch.ones(1, 1),
              S("dapo", epsilon=eps, epsilon_high=eps_high))[0].backward()
    return x.grad.item()


@pytest.mark.parametrize(("eps_high", "upper"), [(None, 1.2), (0.28, 1.28)])
def test_clip_boundaries(eps_high, upper):
    # A > 0: clipped (no gradient) above 1 + eps_high, but not below it, and never from below
    assert _token_grad(math.log(upper + 0.01), 1.5, eps_high=eps_high) == 0.0
    assert _token_grad(math.log(upper - 0.01), 1.5, eps_high=eps_high) == pytest.approx(-1.5 * (upper - 0.01))
    assert _token_grad(math.log(0.5), 1.5, eps_high=eps_high) == pytest.approx(-1.5 * 0.5)
    # A < 0: clipped below 1 - eps, not above it, and never from above (pessimistic bound)
    assert _token_grad(math.log(0.79), -2.0, eps_high=eps_high) == 0.0
    assert _token_grad(math.log(0.81), -2.0, eps_high=eps_high) == pytest.approx(2.0 * 0.81)
    assert _token_grad(math.log(1.6), -2.0, eps_high=eps_high) == pytest.approx(2.0 * 1.6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
@pytest.mark.parametrize("c", [0.5, 3.0])
def test_loss_and_gradient_are_linear_in_positive_advantage_scale(loss_type, c):
    logp, old, _, adv, mask = random_batch(4)
    results = []
    for a in (adv, c * adv):
        x = logp.clone().requires_grad_(True)
        loss, _ = grpo_loss(x, old, None, a, mask, S(loss_type))
        loss.backward()
        results.append((loss.item(), x.grad))
    (l1, g1), (l2, g2) = results
    assert l1 != 0.0
    assert l2 == pytest.approx(c * l1, rel=1e-12)
    assert torch.allclose(g2, c * g1, rtol=1e-12, atol=0)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_padding_columns_change_nothing(loss_type):
    logp, old, ref, adv, mask = random_batch(5)
    n, t = mask.shape
    g = torch.Generator().manual_seed(99)
    pad = lambda x: torch.cat([x, 3 * torch.randn(n, 4, generator=g, dtype=x.dtype)], dim=1)  # noqa: E731
    padded = (pad(logp), pad(old), pad(ref), torch.cat([mask, torch.zeros(n, 4, dtype=mask.dtype)], dim=1))

    out = []
    for lp, o, r, m in ((logp, old, ref, mask), padded):
        x = lp.clone().requires_grad_(True)
        # dr_grpo divides by T_max, which must stay the batch's max length, not the padded width
        loss, stats = grpo_loss(x, o, r, adv, m, S(loss_type, beta=0.05, max_length=t))
        loss.backward()
        out.append((loss.item(), x.grad, stats))
    (l1, g1, s1), (l2, g2, s2) = out
    assert l2 == pytest.approx(l1, rel=1e-12)
    assert torch.equal(g2[:, :t], g1)
    assert (g2[:, t:] == 0).all()
    assert s2 == pytest.approx(s1, rel=1e-12)


# Two responses of 4 and 3 valid tokens, A = +1 and -0.5, with the entropies of tests/test_entropy.py's
# rules that keep every token (``archer`` high: (0, 2), (1, 1), each row's own 0.8 quantile;
# ``sent_kl`` low: below the step's 0.47, (0, 0), (0, 3), (1, 0), (1, 1), (1, 2)).
ENT5 = torch.tensor([[0.1, 0.5, 0.9, 0.3, 9.0], [0.2, 0.35, 0.25, 9.0, 9.0]])
MASK5 = torch.tensor([[1.0, 1, 1, 1, 0], [1, 1, 1, 0, 0]])
ADV5 = torch.tensor([1.0, -0.5])
# log ratios: row 0 = 0, 0.3, 0.3, -0.1; row 1 = -0.3, -0.4, 0 (padding 0)
OLD5 = torch.tensor([[-1.0, -1.3, -0.8, -0.4, 0.0], [-0.3, -0.1, -1.0, 0.0, 0.0]])
LOGP5 = OLD5 + torch.tensor([[0.0, 0.3, 0.3, -0.1, 0.0], [-0.3, -0.4, 0.0, 0.0, 0.0]])
# ref - logp: row 0 = 0.5, 0, 0.4, -0.2; row 1 = 0.2, 0.3, 0
REF5 = LOGP5 + torch.tensor([[0.5, 0.0, 0.4, -0.2, 0.0], [0.2, 0.3, 0.0, 0.0, 0.0]])


def _k3(d: float) -> float:
    return math.exp(d) - d - 1


def test_archer_and_sent_kl_token_terms_by_hand():
    """The token terms of ``clipped`` with each rule's bounds, and ``grpo_loss`` with its KL weights.

    ``archer``: the high token (0, 2) has ratio e^0.3 = 1.35 (A > 0), outside 1 + 0.2 but inside
    1 + 0.5: unclipped, -1.350; so is (1, 1), e^-0.4 = 0.670 (A < 0), inside 1 - 0.5: +0.5 x 0.670 =
    0.335; the low tokens clip at 0.2: (0, 1) -1.2, (1, 0) +0.4. ``sent_kl`` clips every token at
    0.2: (0, 2) -1.2, (1, 1) +0.4. KL 0.001 x k3 on the low tokens only: archer k3(0.5) + k3(-0.2)
    + k3(0.2) (the high (0, 2)'s k3(0.4) and (1, 1)'s k3(0.3) left out); sent_kl adds (1, 1)'s
    k3(0.3). ``dapo`` divides the sum by the 7 valid tokens, ``grpo`` each row by its own count;
    the ``kl`` statistic is the mean k3 of every valid token either way."""
    from dataclasses import replace

    from grpo.algorithm.entropy import build_token_rule
    from grpo.config.sections.train import TrainConfig

    e01, e04, e03, em01 = math.exp(0.3), math.exp(-0.4), math.exp(-0.3), math.exp(-0.1)
    policy = {"archer": [[-1.0, -1.2, -e01, -em01, 0.0], [0.4, 0.5 * e04, 0.5, 0.0, 0.0]],
              "sent_kl": [[-1.0, -1.2, -1.2, -em01, 0.0], [0.4, 0.4, 0.5, 0.0, 0.0]]}
    kl_low = {"archer": [[_k3(0.5), 0.0, 0.0, _k3(-0.2)], [_k3(0.2), 0.0, 0.0]],
              "sent_kl": [[_k3(0.5), 0.0, 0.0, _k3(-0.2)], [_k3(0.2), _k3(0.3), 0.0]]}
    assert 1 - 0.5 < e04 < 1 - 0.2 and 1 + 0.2 < e01 < 1 + 0.5 and e03 < 1 - 0.2
    k3_mean = (_k3(0.5) + _k3(0.4) + _k3(-0.2) + _k3(0.2) + _k3(0.3)) / 7
    for name in ("archer", "sent_kl"):
        cfg = TrainConfig(loss={"entropy_rule": name}).loss
        rule, settings = build_token_rule(cfg), build_loss(cfg, None)
        threshold = rule.threshold(ENT5[MASK5.bool()]) if rule.needs_statistic() else None
        terms = rule.loss_terms(ENT5, MASK5, threshold)
        eps, eps_high = settings.bounds(terms)
        per_token, _ = POLICY_LOSSES["clipped"](LOGP5, OLD5, ADV5.unsqueeze(1), MASK5, epsilon=eps, epsilon_high=eps_high)
        torch.testing.assert_close(per_token * MASK5, torch.tensor(policy[name]), rtol=0, atol=1e-6)
        rows = [sum(p) + 0.001 * sum(k) for p, k in zip(policy[name], kl_low[name])]
        for loss_type, expected in (("dapo", sum(rows) / 7), ("grpo", (rows[0] / 4 + rows[1] / 3) / 2)):
            loss, stats = grpo_loss(LOGP5, OLD5, REF5, ADV5, MASK5, replace(settings, aggregation=AGGREGATIONS[loss_type]),
                                    terms=terms)
            assert loss.item() == pytest.approx(expected, abs=1e-6), (name, loss_type)
            assert stats["kl"] == pytest.approx(k3_mean, rel=1e-5)
        logp = LOGP5.clone().requires_grad_(True)  # the high token (0, 2): a gradient under archer only
        grpo_loss(logp, OLD5, REF5, ADV5, MASK5, settings, terms=terms)[0].backward()
        assert logp.grad[0, 2].item() == pytest.approx(-e01 / 7 if name == "archer" else 0.0, abs=1e-7)


def test_kl_weights_need_reference():
    with pytest.raises(ValueError, match="kl_weights needs ref_logp"):
        grpo_loss(LOGP, OLD, None, ADV, MASK, terms=LossTerms(kl_weights=torch.ones_like(LOGP)))


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo"])
def test_term_gradient_norms_are_those_of_each_term_alone(loss_type):
    """policy_grad_sq is the squared gradient norm (at the log-probs) of the loss without its KL;
    kl_grad_sq that of the loss with the KL minus the loss without it."""
    logp, old, ref, adv, mask = random_batch(6)
    weights = torch.rand(mask.shape, generator=torch.Generator().manual_seed(5), dtype=logp.dtype)
    grads = []
    for kl_weights in (None, weights):
        x = logp.clone().requires_grad_(True)
        loss, stats = grpo_loss(x, old, ref, adv, mask, S(loss_type, beta=0.0), terms=LossTerms(kl_weights=kl_weights))
        loss.backward()
        grads.append(x.grad)
    g_policy, g_both = grads
    assert stats["policy_grad_sq"] == pytest.approx(float(g_policy.pow(2).sum()), rel=1e-9)
    assert stats["kl_grad_sq"] == pytest.approx(float((g_both - g_policy).pow(2).sum()), rel=1e-9)
    assert stats["kl_grad_sq"] > 0


# ---------------------------------------------------------------------- where a rule acts
def test_policy_token_grads_are_the_losss_own_gradient_at_every_token():
    """With every token carrying gradient, |d grpo_loss / d logp| at beta 0 equals
    ``policy_token_grads`` token by token, for both aggregations and with importance weights; 0 off
    the mask."""
    weights = torch.tensor([[1.0, 0.5, 2.0], [1.5, 1.0, 1.0]])
    for loss_type in ("dapo", "grpo"):
        logp = LOGP.clone().requires_grad_(True)
        loss, _ = grpo_loss(logp, OLD, None, ADV, MASK, S(loss_type, epsilon=0.2), terms=LossTerms(token_weights=weights))
        (want,) = torch.autograd.grad(loss, logp)
        got = policy_token_grads(LOGP, OLD, ADV, MASK, S(loss_type, epsilon=0.2, epsilon_high=0.2),
                                 terms=LossTerms(token_weights=weights))
        torch.testing.assert_close(got, want.abs() * MASK)
        assert got[1, 2] == 0 and (got[0, 0] == 0) and got[0, 1] > 0  # padding; clipped (ratio e^0.3, A > 0); inside


def test_policy_token_grads_on_policy_are_the_advantage_over_the_normaliser():
    """At ratio 1 (mu 1) the clipped term's gradient is -A: with ``dapo`` |A_i| / (valid tokens)."""
    got = policy_token_grads(LOGP, LOGP, ADV, MASK, S("dapo", epsilon=0.2, epsilon_high=0.2))
    want = ADV.abs().unsqueeze(1) * MASK / MASK.sum()
    torch.testing.assert_close(got, want.to(got.dtype))


def test_the_wide_clip_band_is_where_ppo_clips_and_the_wider_clip_does_not():
    """Row 0 (A > 0) and row 1 (A < 0) with ratios on both sides of 1 +- 0.2 and 1 +- 0.5; the first
    five tokens of each row carry the wider clip 0.5, the sixth the ordinary 0.2, the seventh is
    padding (ratio in the band). The band is exactly the wider-clip tokens where plain PPO's gradient
    is 0 and the wider clip's is not; its members by hand: row 0 ratios 1.3 and 1.45, row 1 0.7 and 0.55."""
    ratio = torch.tensor([[1.0, 1.1, 1.3, 1.45, 1.6, 1.3, 1.3], [1.0, 0.9, 0.7, 0.55, 0.4, 0.7, 0.7]])
    old = torch.zeros_like(ratio)
    logp = ratio.log()
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1, 1, 1, 1, 1, 1, 0]] * 2)
    wide_eps = torch.tensor([[0.5] * 5 + [0.2, 0.5]] * 2)
    wide, band = wide_clip_band(ratio, adv.unsqueeze(1), mask, 0.2, 0.2, wide_eps, wide_eps)
    assert torch.equal(wide, (wide_eps > 0.2) & mask.bool())
    by_hand = torch.zeros_like(band)
    by_hand[0, 2] = by_hand[0, 3] = by_hand[1, 2] = by_hand[1, 3] = True
    assert torch.equal(band, by_hand)
    ppo = policy_token_grads(logp, old, adv, mask, S(epsilon=0.2, epsilon_high=0.2))
    rule = policy_token_grads(logp, old, adv, mask, terms=LossTerms(epsilon=wide_eps, epsilon_high=wide_eps))
    assert torch.equal(band, wide & (ppo == 0) & (rule > 0))
