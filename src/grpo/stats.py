"""Paired comparisons across seeds that survive correction: t-tests, Holm's step-down adjustment,
and the smallest difference a design detects.

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
    from scipy.optimize import brentq

    if n < 2 or sd <= 0:
        raise ValueError(f"detectable: needs n >= 2 and sd > 0 (n={n}, sd={sd})")
    hi = sd
    while power(hi, sd, n, alpha) < target:
        hi *= 2
    return float(brentq(lambda d: power(d, sd, n, alpha) - target, 0.0, hi, xtol=1e-9))


def pooled_sd(diff_lists: list[tuple[float, ...]]) -> float:
    """The spread of per-seed differences pooled over comparisons: the root mean of their
    variances, each with ``n - 1`` degrees of freedom (comparisons of fewer than two pairs are left out)."""
    pairs = [(len(d) - 1, statistics.variance(d)) for d in diff_lists if len(d) >= 2]
    if not pairs:
        raise ValueError("pooled_sd: no comparison with two pairs")
    return math.sqrt(sum(df * v for df, v in pairs) / sum(df for df, _ in pairs))
