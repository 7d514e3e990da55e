"""Paired comparisons across seeds that survive correction: t-tests, Holm's step-down adjustment,
and the smallest difference a design detects; and one run's accuracy interval that counts a
repeated problem once (``clustered_interval``).

Each comparison is a variant against a reference on the same seeds: ``d_s = metric(variant, s) -
metric(reference, s)``. Pairing removes what a seed does to both runs alike (data order,
sampling), so only the variant's effect and the run-to-run noise remain in ``d``.

- ``paired_test``: the two-sided one-sample t-test of mean(d) = 0 (scipy's ``ttest_1samp``).
- ``holm``: Holm's step-down adjustment of a family of p-values (family-wise error at alpha, any
  dependence between the comparisons): sort ascending, ``p_(i) * (m - i + 1)``, running maximum,
  capped at 1.
- ``detectable``: the smallest true mean difference that a two-sided paired t-test at level
  ``alpha`` finds with probability ``power`` on ``n`` seeds whose differences have standard
  deviation ``sd``; exact, from the non-central t (scipy), not the normal approximation. With
  Holm over ``m`` comparisons, the strictest level a comparison can face is ``alpha / m``: use it
  to say what the whole family can detect.
- ``noninferiority``: the one-sided paired t-test of a cheaper candidate against an incumbent,
  ``d_s = incumbent - candidate``: H0 mean(d) >= ``margin`` (the candidate is worse by the margin
  or more) against H1 mean(d) < ``margin``; a small p says the candidate is not worse by the
  margin. ``noninferiority_power`` is that test's power when the true difference is ``delta``,
  ``noninferiority_margin`` the smallest margin it establishes with probability ``target`` when
  the two are truly equal: a committed margin below it leaves a non-inferior candidate likely
  unproven.
- ``clustered_interval``: a proportion over rows that fall into clusters (the same problem in
  other words or order), its 95% interval from the cluster-robust variance and the effective n.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass


@dataclass(frozen=True)
class PairedTest:
    n: int
    mean: float
    sd: float  # of the per-seed differences; 0 with one pair
    p: float  # two-sided; 1.0 when it cannot be computed (one pair, or all differences equal)
    low: float | None  # 95% t-interval of the mean (unadjusted); None below two pairs
    high: float | None


def paired_test(diffs: list[float] | tuple[float, ...]) -> PairedTest:
    """The t-test of the per-seed differences ``diffs`` against zero."""
    from scipy import stats

    n = len(diffs)
    if n == 0:
        raise ValueError("paired_test: no pairs")
    mean = statistics.fmean(diffs)
    if n < 2:
        return PairedTest(n, mean, 0.0, 1.0, None, None)
    sd = statistics.stdev(diffs)
    if sd == 0.0:  # identical differences: no spread to test against; 0 or a constant shift
        return PairedTest(n, mean, 0.0, 1.0 if mean == 0 else 0.0, mean, mean)
    p = float(stats.ttest_1samp(diffs, 0.0).pvalue)
    half = float(stats.t.ppf(0.975, n - 1)) * sd / math.sqrt(n)
    return PairedTest(n, mean, sd, p, mean - half, mean + half)


def holm(pvalues: dict[str, float]) -> dict[str, float]:
    """Holm-adjusted p-values of a family ``{comparison: p}``: reject a comparison at family-wise
    level alpha when its adjusted p is below alpha."""
    order = sorted(pvalues, key=pvalues.get)
    m, running, out = len(order), 0.0, {}
    for i, name in enumerate(order):
        running = max(running, min(1.0, pvalues[name] * (m - i)))
        out[name] = running
    return out


def power(delta: float, sd: float, n: int, alpha: float) -> float:
    """Probability that the two-sided paired t-test at ``alpha`` rejects when the true mean
    difference is ``delta`` (non-central t with ``n - 1`` degrees of freedom)."""
    from scipy import stats

    df, nc = n - 1, delta * math.sqrt(n) / sd
    crit = float(stats.t.ppf(1 - alpha / 2, df))
    upper, lower = float(stats.nct.sf(crit, df, nc)), float(stats.nct.cdf(-crit, df, nc))
    return upper + (0.0 if math.isnan(lower) else lower)  # scipy's far tail can be NaN: it is ~0 there


def detectable(sd: float, n: int, alpha: float = 0.05, target: float = 0.8) -> float:
    """The smallest mean difference detected with probability ``target`` (``power``) at level
    ``alpha`` by ``n`` paired seeds with difference spread ``sd``."""
    return _smallest("detectable", lambda d: power(d, sd, n, alpha), sd, n, target)


def _smallest(what: str, power_at, sd: float, n: int, target: float) -> float:
    """The smallest ``x >= 0`` where ``power_at(x)`` (rising in ``x``) reaches ``target``: an upper
    bound found by doubling from ``sd``, then the root (scipy's ``brentq``); ``what`` names the
    caller in the error for ``n < 2`` or ``sd <= 0``."""
    from scipy.optimize import brentq

    if n < 2 or sd <= 0:
        raise ValueError(f"{what}: needs n >= 2 and sd > 0 (n={n}, sd={sd})")
    hi = sd
    while power_at(hi) < target:
        hi *= 2
    return float(brentq(lambda x: power_at(x) - target, 0.0, hi, xtol=1e-9))


def noninferiority(diffs: list[float] | tuple[float, ...], margin: float) -> float:
    """One-sided p of H0 ``mean(diffs) >= margin`` (``diffs``: incumbent - candidate per seed)
    against ``mean(diffs) < margin``, by the paired t-test; with no spread, 0 when every difference
    is below the margin, else 1 (ValueError below two pairs)."""
    from scipy import stats

    n = len(diffs)
    if n < 2:
        raise ValueError(f"noninferiority: needs two pairs or more, got {n}")
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    if sd == 0.0:
        return 0.0 if mean < margin else 1.0
    return float(stats.t.cdf((mean - margin) * math.sqrt(n) / sd, n - 1))


def noninferiority_power(margin: float, sd: float, n: int, alpha: float, delta: float = 0.0) -> float:
    """Probability that ``noninferiority`` at ``alpha`` rejects H0 on ``n`` seeds of spread ``sd``
    when the true mean difference (incumbent - candidate) is ``delta`` (non-central t)."""
    from scipy import stats

    df = n - 1
    crit = float(stats.t.ppf(1 - alpha, df))
    return float(stats.nct.sf(crit, df, (margin - delta) * math.sqrt(n) / sd))


def noninferiority_margin(sd: float, n: int, alpha: float = 0.05, target: float = 0.8) -> float:
    """The smallest margin that ``noninferiority`` at ``alpha`` establishes with probability
    ``target`` on ``n`` seeds of spread ``sd`` when candidate and incumbent are truly equal."""
    return _smallest("noninferiority_margin", lambda m: noninferiority_power(m, sd, n, alpha), sd, n, target)


def pooled_sd(diff_lists: list[tuple[float, ...]]) -> float:
    """The spread of per-seed differences pooled over comparisons: the root mean of their
    variances, each with ``n - 1`` degrees of freedom (comparisons of fewer than two pairs are left out)."""
    pairs = [(len(d) - 1, statistics.variance(d)) for d in diff_lists if len(d) >= 2]
    if not pairs:
        raise ValueError("pooled_sd: no comparison with two pairs")
    return math.sqrt(sum(df * v for df, v in pairs) / sum(df for df, _ in pairs))


def wilson(p: float, n: float, z: float = 1.96) -> tuple[float, float]:
    """The Wilson score interval of a proportion ``p`` observed on ``n`` (possibly fractional:
    an effective n) independent trials; ``(0, 1)`` at ``n`` 0."""
    if n <= 0:
        return 0.0, 1.0
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return max(0.0, centre - half), min(1.0, centre + half)


@dataclass(frozen=True)
class ClusteredInterval:
    accuracy: float
    low: float
    high: float
    n: int  # rows
    clusters: int  # distinct cluster keys
    effective_n: float  # n / design effect, at most n
    design_effect: float  # cluster-robust variance / binomial variance, at least 1


CLUSTERED_METHOD = ("Wilson interval at the effective n (n / design effect, the design effect from the "
                    "cluster-robust variance of the proportion, clusters = operand multisets)")
"""How ``clustered_interval`` makes its interval, in words for the metrics files and the report."""


def clustered_interval(outcomes: list[bool], clusters: list[object], z: float = 1.96) -> ClusteredInterval:
    """The accuracy of ``outcomes`` (one per row) and its interval, counting each cluster (rows of
    one key of ``clusters``: the same problem in other words or order) as one draw.

    Algorithm (a ratio estimator over clusters, as survey statistics treats cluster samples): with
    G clusters, cluster g holding n_g rows of which y_g are correct, p = sum y_g / n and

        var_c(p) = sum_g (y_g - p * n_g)^2 / n^2      (cluster-robust, the sandwich without G / (G - 1))
        deff     = max(1, var_c(p) / (p (1 - p) / n))  (design effect)
        n_eff    = n / deff

    and the interval is Wilson's at (p, n_eff) (``wilson``; Korn and Graubard's effective-n
    interval), which stays inside [0, 1] near 0 and 1. Both variances are the plug-in (n, not
    n - 1) ones, so with every cluster of one row var_c is the binomial variance and the interval is
    Wilson's exactly; G / (G - 1) would widen it by under 0.2% at the 310 and 148 clusters of the
    default's splits. deff is floored at 1, so clustering never narrows the interval below the
    independent-rows one. Where the binomial variance is 0 (p is 0 or 1) deff is 1. Raises
    ``ValueError`` on lengths that differ or no rows.
    """
    if len(outcomes) != len(clusters) or not outcomes:
        raise ValueError(f"clustered_interval: {len(outcomes)} outcomes, {len(clusters)} cluster keys")
    sums: dict[object, list[int]] = {}
    for ok, key in zip(outcomes, clusters):
        cell = sums.setdefault(key, [0, 0])
        cell[0] += int(bool(ok))
        cell[1] += 1
    n, g = len(outcomes), len(sums)
    p = sum(y for y, _ in sums.values()) / n
    binomial = p * (1 - p) / n
    robust = sum((y - p * m) ** 2 for y, m in sums.values()) / n**2
    deff = max(1.0, robust / binomial) if binomial > 0 else 1.0
    low, high = wilson(p, n / deff, z)
    return ClusteredInterval(p, low, high, n, g, n / deff, deff)
