"""Paired tests, Holm's adjustment and the detectable difference, against worked cases and a simulation."""

import random
import statistics

import pytest

from grpo.algorithm.stats import detectable, holm, paired_test, pooled_sd, power


def test_paired_test_matches_the_t_statistic_by_hand():
    d = [0.04, 0.01, 0.06, -0.01, 0.03, 0.05]
    r = paired_test(d)
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    t = mean / (sd / len(d) ** 0.5)
    from scipy import stats
    assert r.mean == pytest.approx(mean) and r.sd == pytest.approx(sd)
    assert r.p == pytest.approx(2 * stats.t.sf(abs(t), len(d) - 1))
    assert r.low < mean < r.high


def test_holm_worked_example():
    # sorted p: 0.01 (x3 = 0.03), 0.02 (x2 = 0.04), 0.04 (x1 = 0.04, kept monotone)
    adj = holm({"a": 0.04, "b": 0.01, "c": 0.02})
    assert adj == pytest.approx({"b": 0.03, "c": 0.04, "a": 0.04})
    assert holm({"a": 0.6, "b": 0.5}) == pytest.approx({"b": 1.0, "a": 1.0})  # capped at 1


def test_holm_is_monotone_in_the_raw_order():
    raw = {"x": 0.001, "y": 0.03, "z": 0.02, "w": 0.2}
    adj = holm(raw)
    order = sorted(raw, key=raw.get)
    assert [adj[k] for k in order] == sorted(adj.values())
    assert all(adj[k] >= raw[k] for k in raw)


def test_detectable_difference_has_the_power_it_claims_in_simulation():
    """Draw many six-seed experiments with the detectable mean: about 80% are rejected at alpha."""
    from scipy import stats

    sd, n, alpha = 0.04, 6, 0.05
    delta = detectable(sd, n, alpha)
    assert power(delta, sd, n, alpha) == pytest.approx(0.8, abs=1e-6)
    rng = random.Random(0)
    trials = 4000
    hits = sum(stats.ttest_1samp([rng.gauss(delta, sd) for _ in range(n)], 0.0).pvalue < alpha for _ in range(trials))
    assert hits / trials == pytest.approx(0.8, abs=0.03)
    assert detectable(sd, n, alpha / 5) > delta  # a stricter level needs a larger difference


def test_pooled_sd_weights_by_degrees_of_freedom():
    a, b = (0.0, 0.1, 0.2), (0.0, 0.3)
    expected = ((2 * statistics.variance(a) + 1 * statistics.variance(b)) / 3) ** 0.5
    assert pooled_sd([a, b, (0.5,)]) == pytest.approx(expected)


def test_clustered_interval_of_single_row_clusters_is_wilsons():
    from grpo.algorithm.stats import clustered_interval
    from grpo.evaluation.evaluate import wilson_interval

    outcomes = [True] * 41 + [False] * 459
    ci = clustered_interval(outcomes, list(range(500)))
    assert (ci.low, ci.high) == pytest.approx(wilson_interval(41, 500))
    assert (ci.clusters, ci.design_effect, ci.effective_n) == (500, 1.0, 500)


def test_clustered_interval_counts_a_repeated_problem_once():
    """Ten problems each asked twice, both askings answered alike: the pairs are 10 draws, not 20.
    By hand: p = 0.5, y_g - p n_g = +-1 in every cluster, var = 10 / 400 = 0.025, binomial
    0.25 / 20 = 0.0125, deff = 2, n_eff = 10: the clusters."""
    from grpo.algorithm.stats import clustered_interval, wilson

    outcomes = [g < 5 for g in range(10) for _ in range(2)]
    keys = [g for g in range(10) for _ in range(2)]
    ci = clustered_interval(outcomes, keys)
    assert ci.accuracy == 0.5 and ci.clusters == 10 and ci.n == 20
    assert ci.design_effect == pytest.approx((10 / 400) / (0.25 / 20))
    assert ci.effective_n == pytest.approx(ci.clusters)
    assert (ci.low, ci.high) == pytest.approx(wilson(0.5, ci.clusters))
    independent = clustered_interval(outcomes, list(range(20)))
    assert ci.high - ci.low > independent.high - independent.low


def test_clustered_interval_never_narrows_below_independent_rows():
    """Mixed clusters (one right, one wrong each) vary less than independent rows: deff is floored at 1."""
    from grpo.algorithm.stats import clustered_interval

    ci = clustered_interval([True, False] * 10, [g for g in range(10) for _ in range(2)])
    assert ci.design_effect == 1.0 and ci.effective_n == 20
    with pytest.raises(ValueError):
        clustered_interval([True], [0, 1])


def test_the_noninferiority_test_and_its_power_agree_with_a_simulation():
    """The one-sided test of 'worse by the margin' at alpha 0.05 rejects in about 80% of simulated
    designs at ``noninferiority_margin``'s margin when the true difference is 0, and in about 5%
    when the candidate is truly worse by exactly the margin."""
    import random

    from grpo.algorithm.stats import noninferiority, noninferiority_margin, noninferiority_power

    sd, n = 0.1, 8
    margin = noninferiority_margin(sd, n, 0.05)
    assert abs(noninferiority_power(margin, sd, n, 0.05) - 0.8) < 1e-6
    rng = random.Random(0)

    def rejected(delta):
        return sum(noninferiority([rng.gauss(delta, sd) for _ in range(n)], margin) < 0.05 for _ in range(4000)) / 4000

    assert abs(rejected(0.0) - 0.8) < 0.03 and abs(rejected(margin) - 0.05) < 0.015
