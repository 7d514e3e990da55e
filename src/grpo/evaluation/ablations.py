"""Ablations: a declared grid of variants run as DVC experiments over seeds, compared in pairs.

    python -m grpo.evaluation.ablations run      [--grid experiments/ablations.yaml] [--out-dir outputs/ablations]
    python -m grpo.evaluation.ablations compare  [--grid ...] [--out-dir ...]   # the comparison alone

The grid file names a ``reference`` variant, the ``seeds`` and ``variants``: name -> params overrides
(``{"train.order": "shuffled"}``), each checked against ``grpo.config.reading`` before anything is queued;
``confirms``: the grid file whose decision a grid of one variant and no decision runs again on
fresh seeds (its headline is that variant's: ``headline_pick``); optionally a ``decision``: the rule that picks a default from the results (``candidates``, ``margin``: the
cheapest within the margin of the best; or ``rule: noninferior`` with an ``incumbent``: the cheapest
candidate shown not worse than the incumbent by the margin; ``decide``),
and ``paired_with``: variants compared to another variant than the reference (the curriculum against
shuffled order under one rule), in the same Holm family as the rest; ``seed_keys``: the params keys
that take the experiment's seed (default ``[train.seed]``; ``[data.seed, sent.seed, train.seed]``
varies which problems are drawn and SENT's samples with the training seed, a seed triple); and
``pinned``: params keys every variant must set itself (``[train.optimizer.mu]``: a variant's meaning does not
move when params.yaml's default does).
Variant ``v`` with seed ``s`` is the experiment ``v-seed-s``: ``dvc exp run --queue -S
<seed key>=s ... -S <overrides> -n v-seed-s``, queued and run one seed at a time (every variant of seed 0
first, so a run cut short still leaves pairs). Before a seed's experiments are queued, the stages
no variant sets a param of (data, SENT, baseline) run once in the workspace for that seed
(``grpo.evaluation.seed_stages``): a queued experiment then skips them instead of making the same bytes again.
``run`` reads ``dvc exp show`` first and queues only the experiments that have no result and are
not waiting in the queue (failed ones are removed from the queue and queued again; tasks left
"running" by a worker that died are removed first: ``clear_stale``), then runs each seed's queue
with one worker (``dvc exp run --run-all --jobs 1``): a second call after a finished run queues
nothing and runs nothing. Once every experiment has a
result, ``run`` compares them (below), so one command does the whole grid.

``compare`` pairs each variant with the reference on the seeds both finished: the difference
``d_s = metric(v, s) - metric(reference, s)`` per seed, its mean and two-sided paired t-test
(``grpo.algorithm.stats``), for two metrics: the last step's validation accuracy (``SELECT``: the shipped
adapter is the best of several checkpoints on validation, so its own validation figure is biased
upward; the last step's is not chosen on anything) and the shipped adapter's test accuracy. Every
comparison of both metrics is one family: p-values are Holm-adjusted over all of them, and a
verdict ("better", "worse") needs an adjusted p below 0.05. The table also gives each variant's
mean with its 95% interval across seeds, the train stage's seconds, how many tokens the clip bound
and the KL term's share of the gradient, and what the design detects with 80% power. It writes
``ablations.md``, ``ablations.json`` and ``ablations.png`` (a forest plot) into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path

from grpo.algorithm.stats import (
    PairedTest,
    detectable,
    holm,
    noninferiority,
    noninferiority_margin,
    paired_test,
    pooled_sd,
)
from grpo.config.params import params_from_dict
from grpo.config.reading import ParamsError, read_params_yaml
from grpo.core.dvcfile import DVC_YAML, read_stages
from grpo.evaluation import seed_headline, seed_stages
from grpo.evaluation.experiments import SEED_KEY, Run, cli_value, dvc, exp_show, parse_runs, read_runs

GRID = "experiments/ablations.yaml"
OUT_DIR = "outputs/ablations"
TEST = "metrics/final.json:accuracy"  # the shipped (best-validation) adapter on the test split
SELECT = "metrics/train.json:final_val_accuracy"  # the last step's validation: no checkpoint chosen on it
COST = "metrics/train.json:total_time_s"
CLIP = "metrics/train.json:mean_clip_frac"
CLIP_STEPS = "metrics/train.json:clip_bound_steps"
KL_SHARE = "metrics/train.json:mean_kl_grad_share"
BAND = "metrics/train.json:mean_wide_band_frac"  # archer: wider-clip tokens beyond the ordinary clip
BAND_SHARE = "metrics/train.json:mean_wide_band_grad_share"  # ... and their share of the policy gradient
KEPT_SHARE = "metrics/train.json:mean_kept_grad_share"  # high: the kept tokens' share of the policy gradient
CLIP_ACTING = "metrics/train.json:mean_clip_frac_acting"  # the clip over the tokens where it can act
BAND_ACTING = "metrics/train.json:mean_wide_band_frac_acting"  # archer's band over the wider-clip tokens that can act
ZERO_ADV = "metrics/train.json:mean_zero_adv_update_frac"  # the update's rows of zero advantage (equal rewards)
KEPT = "metrics/train.json:mean_kept_frac"  # the kept fraction of the valid tokens (high's kept share)
BEFORE = "metrics/baseline.json:accuracy"  # the base model on the seed's test split: the same for every variant
N_EFF_BEFORE = "metrics/baseline.json:effective_n"  # n / design effect, clusters = operand multisets
N_EFF_AFTER = "metrics/final.json:effective_n"
ROWS = "metrics/final.json:n"  # the test split's rows
COMPARED = (SELECT, TEST)
METRICS = (SELECT, TEST, COST, CLIP, CLIP_STEPS, KL_SHARE, BAND, BAND_SHARE, KEPT_SHARE, CLIP_ACTING, BAND_ACTING,
           ZERO_ADV, KEPT, BEFORE, N_EFF_BEFORE, N_EFF_AFTER, ROWS)
ALPHA = 0.05


@dataclass(frozen=True)
class Grid:
    """A declared ablation grid (the contract of ``experiments/ablations.yaml``)."""

    reference: str
    seeds: tuple[int, ...]
    variants: dict[str, dict[str, object]]  # name -> {"train.order": "shuffled", ...}
    decision: dict | None = None  # {"candidates": [variant, ...], "margin": float}: the rule ``decide`` applies
    paired_with: dict[str, str] = field(default_factory=dict)  # variant -> the variant it is compared to (else reference)
    seed_keys: tuple[str, ...] = (SEED_KEY,)  # the params keys set to the experiment's seed
    pinned: tuple[str, ...] = ()  # params keys every variant sets itself
    confirms: str | None = None  # the grid file whose decision this one-variant grid confirms on fresh seeds

    def partner(self, variant: str) -> str:
        """The variant ``variant`` is paired with: its ``paired_with`` entry, else the reference."""
        return self.paired_with.get(variant, self.reference)


def _set_dotted(tree: dict, key: str, value: object) -> None:
    *parents, leaf = key.split(".")
    node = tree
    for part in parents:
        if not isinstance(node.get(part), dict):
            raise ValueError(f"{key}: {part!r} is not a params section")
        node = node[part]
    if leaf not in node:
        raise ValueError(f"{key}: no such key in params.yaml")
    node[leaf] = value


def check_overrides(name: str, overrides: dict[str, object], params: dict) -> None:
    """Raise ``ValueError`` naming the variant and key unless ``overrides`` applied to the params
    tree ``params`` (params.yaml as read) give valid params."""
    tree = json.loads(json.dumps(params))
    try:
        for key, value in overrides.items():
            _set_dotted(tree, key, value)
        params_from_dict(tree)
    except (ValueError, ParamsError) as err:
        raise ValueError(f"variant {name!r}: {err}") from None


def check_pairs(path: Path, pairs: dict, variants: dict, reference: str) -> dict[str, str]:
    """``paired_with`` checked: each key and value a variant, none the reference's key, none paired with itself."""
    if not isinstance(pairs, dict) or any(k not in variants or v not in variants or k == v or k == reference
                                          for k, v in pairs.items()):
        raise ValueError(f"{path}: 'paired_with' must map variants (not the reference) to other variants")
    return dict(pairs)


def check_keys(path: Path, raw: dict, name: str, default: tuple[str, ...]) -> tuple[str, ...]:
    """The grid's list ``name`` of dotted params keys (``default`` when absent): distinct strings."""
    keys = raw.get(name, list(default))
    if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys) \
            or (name == "seed_keys" and not keys):
        raise ValueError(f"{path}: '{name}' must be a list of distinct params keys")
    return tuple(keys)


def check_seed_and_pinned_keys(grid: Grid, params: dict) -> None:
    """Raise ``ValueError`` unless every seed key is a params key, no variant sets one, and every
    variant sets every ``pinned`` key."""
    check_overrides("(seed keys)", dict.fromkeys(grid.seed_keys, 0), params)
    for name, overrides in grid.variants.items():
        if set(grid.seed_keys) & set(overrides):
            raise ValueError(f"variant {name!r}: {', '.join(sorted(set(grid.seed_keys) & set(overrides)))} "
                             "is set per experiment by the grid's seeds")
        if missing := [k for k in grid.pinned if k not in overrides]:
            raise ValueError(f"variant {name!r}: does not set {', '.join(missing)} (the grid's 'pinned' keys)")


DECISION_KEYS = {"candidates", "margin"}
"""The keys of the rule "the cheapest candidate within ``margin`` of the best" (``choose_within``)."""
NONINFERIOR_KEYS = {"rule", "incumbent", "candidates", "margin"}
"""The keys of the rule ``rule: noninferior`` (``choose_noninferior``)."""


def check_decision(path: Path, decision: object, variants: dict) -> dict | None:
    """The grid's ``decision`` (None when it has none), or one line naming the file: either
    ``candidates`` and ``margin``, or ``rule: noninferior`` with an ``incumbent`` (a variant, not a
    candidate), ``candidates`` and a positive ``margin``."""
    if decision is None:
        return None
    wanted = NONINFERIOR_KEYS if isinstance(decision, dict) and decision.get("rule") == "noninferior" else DECISION_KEYS
    ok = (isinstance(decision, dict) and set(decision) == wanted and decision["candidates"]
          and set(decision["candidates"]) <= set(variants) and isinstance(decision["margin"], (int, float)))
    if ok and wanted is NONINFERIOR_KEYS:
        ok = decision["incumbent"] in variants and decision["incumbent"] not in decision["candidates"] \
            and decision["margin"] > 0
    if not ok:
        raise ValueError(f"{path}: 'decision' must name 'candidates' (variants of the grid) and a 'margin', or "
                         "'rule: noninferior' with an 'incumbent' variant besides its 'candidates' and a margin > 0")
    return decision


def check_confirms(path: Path, confirms: object, variants: dict, decision: dict | None) -> str | None:
    """The grid's ``confirms`` (None when it has none): the grid file, relative to the repository,
    whose decision this grid confirms. Such a grid has one variant and no decision of its own."""
    if confirms is None:
        return None
    if not isinstance(confirms, str) or len(variants) != 1 or decision is not None:
        raise ValueError(f"{path}: 'confirms' names the grid file whose chosen default this grid runs on fresh seeds: "
                         "a string, in a grid of one variant and no 'decision'")
    if not (Path(path).resolve().parent.parent / confirms).is_file():
        raise ValueError(f"{path}: confirms {confirms!r}, which is not a file of the repository")
    return confirms


def load_grid(path: Path, params_path: Path | None = None) -> Grid:
    """The grid in ``path``; every variant's overrides validated over ``params_path`` (params.yaml
    beside the grid's repository by default) so that a typo fails here, not an hour into a queue."""
    raw = read_params_yaml(path)  # a repeated key or bad YAML: one line naming the file and line
    variants = raw.get("variants") or {}
    if not isinstance(variants, dict) or not variants:
        raise ValueError(f"{path}: 'variants' must map variant names to params overrides")
    reference = raw.get("reference")
    if reference not in variants:
        raise ValueError(f"{path}: reference {reference!r} is not one of the variants ({', '.join(variants)})")
    if "second_reference" in raw:
        raise ValueError(f"{path}: second_reference was dropped: every comparison is to 'reference', "
                         "Holm-adjusted together (docs/results.md)")
    decision = check_decision(path, raw.get("decision"), variants)
    seeds = raw.get("seeds")
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ValueError(f"{path}: 'seeds' must be a list of distinct integers")
    grid = Grid(reference=reference, seeds=tuple(seeds),
                variants={name: dict(over or {}) for name, over in variants.items()}, decision=decision,
                paired_with=check_pairs(path, raw.get("paired_with") or {}, variants, reference),
                seed_keys=check_keys(path, raw, "seed_keys", (SEED_KEY,)), pinned=check_keys(path, raw, "pinned", ()),
                confirms=check_confirms(path, raw.get("confirms"), variants, decision))
    params = read_params_yaml(params_path or Path(path).resolve().parent.parent / "params.yaml")
    check_seed_and_pinned_keys(grid, params)
    for name, overrides in grid.variants.items():
        check_overrides(name, overrides, params)
    return grid


def exp_name(variant: str, seed: int) -> str:
    return f"{variant}-seed-{seed}"


def queue_args(grid: Grid, variant: str, seed: int) -> list[str]:
    """The ``dvc`` arguments that queue ``variant`` with ``seed`` (every one of ``grid.seed_keys`` set to it)."""
    seeds = [arg for key in grid.seed_keys for arg in ("-S", f"{key}={seed}")]
    sets = [arg for key, value in grid.variants[variant].items() for arg in ("-S", f"{key}={cli_value(value)}")]
    return ["exp", "run", "--queue", *seeds, *sets, "-n", exp_name(variant, seed)]


@dataclass
class Plan:
    """What ``run`` does: experiments to queue (seed-major order), already finished, waiting, failed."""

    queue: list[tuple[str, int]] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    waiting: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def plan(grid: Grid, runs: list[Run]) -> Plan:
    """Sort the grid's experiments by what ``dvc exp show`` says of them: finished (a test
    accuracy), waiting in the queue (queued or running), failed (queued again) or absent."""
    by_name: dict[str, Run] = {}
    for r in runs:  # a finished run (a record's, say) is never replaced by an unfinished one of its name
        if r.metric is not None or r.name not in by_name or by_name[r.name].metric is None:
            by_name[r.name] = r
    out = Plan()
    for seed in grid.seeds:
        for variant in grid.variants:
            name, run = exp_name(variant, seed), by_name.get(exp_name(variant, seed))
            if run is not None and run.metric is not None:
                out.done.append(name)
            elif run is not None and run.state in ("queued", "running"):
                out.waiting.append(name)
            else:
                if run is not None:
                    out.failed.append(name)
                out.queue.append((variant, seed))
    return out


# ---------------------------------------------------------------- comparison
@dataclass(frozen=True)
class Paired:
    """A variant against the reference on the seeds both have (``grpo.algorithm.stats.paired_test``), with
    its p-value adjusted by Holm over every comparison the table reports (``adjust``)."""

    seeds: tuple[int, ...]
    diffs: tuple[float, ...]  # variant - reference, per seed
    test: PairedTest | None  # None without a shared seed
    p_holm: float | None = None

    @property
    def mean(self) -> float | None:
        return self.test.mean if self.test else None

    @property
    def verdict(self) -> str:
        if self.test is None or self.test.n < 2:
            return "too few seeds"
        if self.p_holm is None or self.p_holm >= ALPHA:
            return "no detectable difference"
        return "better" if self.test.mean > 0 else "worse"


def paired(reference: dict[int, float], variant: dict[int, float]) -> Paired:
    """Per-seed differences ``variant - reference`` over the seeds in both and their t-test."""
    seeds = tuple(sorted(set(reference) & set(variant)))
    diffs = tuple(variant[s] - reference[s] for s in seeds)
    return Paired(seeds, diffs, paired_test(diffs) if diffs else None)


def values_by_variant(grid: Grid, runs: list[Run]) -> dict[str, dict[int, float]]:
    """``{variant: {seed: metric}}`` of the finished experiments named after the grid (a queued or
    running one shows its baseline's metrics in ``dvc exp show``: not counted)."""
    by_name = {r.name: r for r in runs if r.metric is not None and r.state in (None, "success")}
    return {v: {s: by_name[exp_name(v, s)].metric for s in grid.seeds if exp_name(v, s) in by_name}
            for v in grid.variants}


@dataclass(frozen=True)
class Row:
    """One variant: ``values[metric][seed]`` for every metric of ``METRICS`` it has, and its paired
    comparisons to the reference on the compared metrics (``COMPARED``)."""

    variant: str
    overrides: dict[str, object]
    values: dict[str, dict[int, float]]
    compared: dict[str, Paired]


def rows(grid: Grid, runs: dict[str, list[Run]]) -> list[Row]:
    """The table: ``runs`` maps each metric key of ``METRICS`` to ``dvc exp show``'s runs read for
    it. Every comparison of every compared metric is one member of the Holm family."""
    values = {key: values_by_variant(grid, found) for key, found in runs.items()}
    raw = {(v, key): paired(values[key][grid.partner(v)], values[key][v])
           for key in COMPARED if key in values for v in grid.variants if v != grid.reference}
    adjusted = holm({f"{v}|{key}": p.test.p for (v, key), p in raw.items() if p.test and p.test.n >= 2})
    compared = {k: Paired(p.seeds, p.diffs, p.test, adjusted.get(f"{k[0]}|{k[1]}")) for k, p in raw.items()}
    return [Row(v, grid.variants[v], {key: vals[v] for key, vals in values.items()},
                {key: compared[(v, key)] for key in COMPARED if (v, key) in compared}) for v in grid.variants]


def _f(x: float | None, signed: bool = False, digits: int = 3) -> str:
    return "-" if x is None else (f"{x:+.{digits}f}" if signed else f"{x:.{digits}f}")


def _mean_interval(values: dict[int, float]) -> str:
    """Mean over seeds with its 95% t-interval (across seeds, not paired)."""
    if not values:
        return "-"
    t = paired_test(tuple(values.values()))
    return _interval(t) if t.low is not None else f"{t.mean:.3f}"


def _split_table(grid: Grid, table: list[Row], key: str) -> list[str]:
    """One metric's table: per variant the mean over seeds with its interval, the paired difference
    to the reference with its raw and Holm-adjusted p and verdict, the value per seed, what it changes."""
    head = ["variant", "mean [95%]", f"minus {grid.reference} (paired)", "p", "p (Holm)", "verdict",
            f"seeds {', '.join(map(str, grid.seeds))}", "changes"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in table:
        values, ref = r.values.get(key, {}), r.variant == grid.reference
        pair = r.compared.get(key)
        changes = ", ".join(f"`{k.rpartition('.')[2]}={cli_value(v)}`" for k, v in r.overrides.items())
        cells = [f"**{r.variant}**" if ref else r.variant, _mean_interval(values),
                 "" if ref or pair is None else _f(pair.mean, True) + (
                     f" (vs {grid.partner(r.variant)})" if grid.partner(r.variant) != grid.reference else ""),
                 "" if ref or pair is None or pair.test is None or pair.test.n < 2 else f"{pair.test.p:.3f}",
                 "" if ref or pair is None or pair.p_holm is None else f"{pair.p_holm:.3f}",
                 "reference" if ref else (pair.verdict if pair else "-"),
                 " / ".join(_f(values.get(s)) for s in grid.seeds), changes or "params.yaml"]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _acting_table(grid: Grid, table: list[Row]) -> list[str]:
    """Cost and whether the parts acted: train stage seconds, clip-binding fraction, KL share, and
    where the entropy rule acted (archer's band beyond the ordinary clip: its tokens' fraction and
    gradient share; the kept tokens' gradient share of a rule that drops tokens), means over seeds."""
    lines = ["| variant | train stage s (mean) | tokens clipped (mean per step) | steps the clip bound "
             "| KL share of the gradient (mean) | wide-clip tokens in the band | their gradient share "
             "| kept tokens' gradient share |", "|---|---|---|---|---|---|---|---|"]
    for r in table:
        cells = [r.variant] + [_f(statistics.fmean(v.values()), digits=d) if (v := r.values.get(k)) else "-"
                               for k, d in ((COST, 0), (CLIP, 4), (CLIP_STEPS, 1), (KL_SHARE, 4), (BAND, 4),
                                            (BAND_SHARE, 4), (KEPT_SHARE, 3))]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _power_line(table: list[Row]) -> list[str]:
    """What the design detects: the pooled spread of the paired differences, the smallest mean
    difference found with 80% power at alpha 0.05 and at Holm's strictest level alpha / m."""
    pairs = [p for r in table for p in r.compared.values() if p.test and p.test.n >= 2]
    if not pairs:
        return []
    n, m, sd = min(p.test.n for p in pairs), len(pairs), pooled_sd([p.diffs for p in pairs])
    if sd == 0:
        return []
    return ["", f"{m} comparisons, Holm-adjusted over all of them (family-wise alpha {ALPHA}). With {n} paired "
            f"seeds and the paired differences' spread pooled over the comparisons (sd {sd:.3f}), a true mean "
            f"difference is found with 80% power when it is at least **{detectable(sd, n, ALPHA):.3f}** at alpha "
            f"{ALPHA} alone, and **{detectable(sd, n, ALPHA / m):.3f}** at Holm's strictest level "
            f"(alpha / {m}). A difference below these is not ruled out by a \"no detectable difference\"."]


def markdown(grid: Grid, table: list[Row]) -> str:
    """The comparison: the selection metric's table, the test table, cost and action, power, and
    (with a decision rule in the grid) the rule's outcome."""
    lines = [f"Validation accuracy at the last step (`{SELECT}`: no checkpoint chosen on it; the rule is "
             "chosen on this):", "", *_split_table(grid, table, SELECT), "",
             f"Test accuracy of the shipped adapter (`{TEST}`):", "", *_split_table(grid, table, TEST), "",
             "Cost and whether each part acted (means over seeds):", "", *_acting_table(grid, table),
             *_power_line(table)]
    if per_seed := _acting_per_seed(grid, table):
        lines += ["", "Where the entropy rule acted, per seed:", "", *per_seed]
    pick = None
    if grid.decision:
        pick, decision = choose(grid, table)
        lines += ["", *decision]
    elif grid.confirms:
        pick = headline_pick(grid, table)
        lines += ["", f"Confirms the default `{grid.confirms}` chose, **{pick}**, on seeds it never saw (nothing is "
                  "chosen here)."]
    if heads := _headline_table(table, pick):
        lines += ["", *heads]
    return "\n".join(lines) + "\n"



def decide(grid: Grid, table: list[Row]) -> list[str]:
    """The grid's decision rule applied, in words (``choose``)."""
    return choose(grid, table)[1]


def choose(grid: Grid, table: list[Row]) -> tuple[str | None, list[str]]:
    """The grid's decision rule applied (``choose_noninferior`` for ``rule: noninferior``, else
    ``choose_within``): the chosen variant (None until every candidate has every seed) and the
    lines that say why."""
    rule = choose_noninferior if grid.decision.get("rule") == "noninferior" else choose_within
    return rule(grid, table)


def _waiting(grid: Grid, table: list[Row], names: list[str]) -> list[str] | None:
    """The "not yet" line while an experiment of ``names`` on the grid's seeds has no ``SELECT``
    value (the rule chooses on the whole grid, never on the seeds that happen to have finished)."""
    by_name = {r.variant: r for r in table}
    wanted = [(c, s) for c in names for s in grid.seeds]
    missing = [exp_name(c, s) for c, s in wanted if s not in (by_name[c].values.get(SELECT, {}) if c in by_name else {})]
    if not missing:
        return None
    return [f"Decision: not yet: {len(wanted) - len(missing)} of the candidates' {len(wanted)} experiments "
            f"have finished (waiting: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})."]


def _cost(row: Row) -> float:
    """The mean train-stage seconds of a variant over its seeds (inf where none was recorded)."""
    return statistics.fmean(row.values[COST].values()) if row.values.get(COST) else math.inf


def choose_noninferior(grid: Grid, table: list[Row]) -> tuple[str | None, list[str]]:
    """``rule: noninferior``: each candidate against the ``incumbent`` on ``SELECT``, paired by
    seed (d = incumbent - candidate), by the one-sided test of "worse by ``margin`` or more"
    (``grpo.algorithm.stats.noninferiority``), Holm-adjusted over the candidates. The default is the cheapest
    candidate that is non-inferior (adjusted p below ``ALPHA``) and cheaper than the incumbent;
    otherwise the incumbent stays. The lines give every candidate's mean difference, p, adjusted p
    and cost, and the margin the design establishes with 80% power at Holm's strictest level when
    the two are truly equal (``grpo.algorithm.stats.noninferiority_margin``)."""
    inc, cands, margin = grid.decision["incumbent"], list(grid.decision["candidates"]), float(grid.decision["margin"])
    if (wait := _waiting(grid, table, [inc, *cands])) is not None:
        return None, wait
    by_name = {r.variant: r for r in table}
    top = by_name[inc].values[SELECT]
    diffs = {c: tuple(top[s] - by_name[c].values[SELECT][s] for s in grid.seeds) for c in cands}
    adjusted = holm({c: noninferiority(d, margin) for c, d in diffs.items()})
    cost = {v: _cost(by_name[v]) for v in (inc, *cands)}
    proven = sorted((c for c in cands if adjusted[c] < ALPHA and cost[c] < cost[inc]), key=cost.get)
    pick = proven[0] if proven else inc
    why = (f"the cheapest candidate not worse than {inc} by {margin:.3f} or more (Holm-adjusted p "
           f"{adjusted[pick]:.3f})" if proven else
           f"no cheaper candidate is shown not worse than {inc} by {margin:.3f}: the incumbent stays")
    lines = [f"Decision (rule committed before the grid ran): **{pick}**, {why}, train stage {cost[pick]:.0f} s. "
             "Candidates (incumbent minus candidate, one-sided p of 'worse by the margin', Holm, seconds): "
             + ", ".join(f"{c} ({statistics.fmean(diffs[c]):+.3f}, p {noninferiority(diffs[c], margin):.3f}, "
                         f"Holm {adjusted[c]:.3f}, {cost[c]:.0f} s)" for c in cands)
             + f"; {inc} {cost[inc]:.0f} s."]
    if (sd := pooled_sd(list(diffs.values()))) > 0:
        need = noninferiority_margin(sd, len(grid.seeds), ALPHA / len(cands))
        lines[0] += (f" The paired differences spread with sd {sd:.3f} over {len(grid.seeds)} seeds: the design "
                     f"establishes a margin of {need:.3f} with 80% power when the two are equal (alpha {ALPHA} / "
                     f"{len(cands)})" + ("." if margin >= need else
                                          f"; the committed {margin:.3f} is below it, so a non-inferior candidate "
                                          "is likely left unproven."))
    return pick, lines


def choose_within(grid: Grid, table: list[Row]) -> tuple[str | None, list[str]]:
    """The rule "the cheapest within the margin of the best": among ``decision.candidates``, the cheapest (train stage
    seconds) whose mean paired shortfall on ``SELECT`` to the best variant is at most
    ``decision.margin``; when none is, the best candidate, with its shortfall stated. Returns the
    chosen variant (None until every candidate has every seed) and the lines that say why."""
    by_name = {r.variant: r for r in table}
    means = {r.variant: statistics.fmean(v.values()) for r in table if (v := r.values.get(SELECT))}
    if not means:
        return None, ["Decision: no results yet."]
    wanted = [(c, s) for c in grid.decision["candidates"] for s in grid.seeds]
    done = {c: set(by_name[c].values.get(SELECT, {})) if c in by_name else set() for c in grid.decision["candidates"]}
    missing = [exp_name(c, s) for c, s in wanted if s not in done[c]]
    if missing:  # the rule chooses on the whole grid, never on the seeds that happen to have finished
        return None, [f"Decision: not yet: {len(wanted) - len(missing)} of the candidates' {len(wanted)} experiments "
                f"have finished (waiting: {', '.join(missing[:4])}{', ...' if len(missing) > 4 else ''})."]
    best = max(means, key=means.get)

    def shortfall(name: str) -> float:
        mine, top = by_name[name].values[SELECT], by_name[best].values[SELECT]
        return statistics.fmean(top[s] - mine[s] for s in set(mine) & set(top))

    cands = [c for c in grid.decision["candidates"] if c in means]
    cost = {c: statistics.fmean(by_name[c].values[COST].values()) if by_name[c].values.get(COST) else math.inf
            for c in cands}
    margin = float(grid.decision["margin"])
    ok = sorted((c for c in cands if shortfall(c) <= margin + 1e-9), key=cost.get)  # accuracies are k / n: no float noise
    if ok:
        pick, why = ok[0], f"the cheapest candidate within {margin:.3f} of the best variant ({best})"
    else:
        pick = min(cands, key=shortfall)
        why = f"no candidate is within {margin:.3f} of the best ({best}); the best candidate"
    return pick, [f"Decision (rule committed before the grid ran): **{pick}**, {why}: shortfall "
            f"{shortfall(pick):+.3f} on `{SELECT}`, train stage {cost[pick]:.0f} s. Candidates: "
            + ", ".join(f"{c} ({shortfall(c):+.3f}, {cost[c]:.0f} s)" for c in cands) + "."
            + _decision_power(by_name, best, [c for c in cands if c != best])]


def _decision_power(by_name: dict[str, Row], best: str, others: list[str]) -> str:
    """What the decision's comparisons detect: the paired differences (on ``SELECT``, per shared
    seed) of every other candidate to the best variant, their spread pooled (``grpo.algorithm.stats.pooled_sd``)
    and the smallest mean shortfall a paired t-test at ``ALPHA`` finds with 80% power on the fewest
    shared seeds; empty with fewer than two seeds or no spread."""
    top = by_name[best].values[SELECT]
    diffs = [tuple(top[s] - by_name[c].values[SELECT][s] for s in sorted(set(top) & set(by_name[c].values[SELECT])))
             for c in others]
    diffs = [d for d in diffs if len(d) >= 2]
    if not diffs or (sd := pooled_sd(diffs)) == 0:
        return ""
    n = min(len(d) for d in diffs)
    return (f" The candidates' paired shortfalls to {best} spread with sd {sd:.3f} over {n} seeds: a true "
            f"shortfall is found with 80% power from {detectable(sd, n, ALPHA):.3f} (alpha {ALPHA}).")


@dataclass(frozen=True)
class Headline:
    """A variant's test accuracy before (the base model) and after training, as means over the seeds
    with both sides finished, by one interval method: the 95% t interval across seeds
    (``grpo.algorithm.stats.paired_test`` of the per-seed values). In a grid whose ``seed_keys`` draw the splits,
    SENT's samples and the training run, a seed is one unit: its test rows, repeated operand multisets
    and all, enter as one figure, so no repeated problem is counted as independent. The mean
    effective n per seed (n / design effect, clusters = operand multisets) says how many independent
    problems one seed's test is worth."""

    variant: str
    seeds: tuple[int, ...]
    before: PairedTest
    after: PairedTest
    n_eff_before: float | None  # mean over ``seeds``; None where no run recorded it
    n_eff_after: float | None
    rows: float | None  # the test split's rows (mean over seeds)


def baseline_by_seed(table: list[Row], key: str = BEFORE) -> dict[int, float]:
    """``{seed: value}`` of a baseline metric (``key``) from any variant's run of that seed: the base
    model's evaluation does not depend on the variant, so two runs of one seed that disagree mean
    the stage is not reproducible (``ValueError`` naming the seed)."""
    out: dict[int, float] = {}
    for r in table:
        for seed, value in r.values.get(key, {}).items():
            if seed in out and not math.isclose(out[seed], value, rel_tol=1e-9):
                raise ValueError(f"seed {seed}: {key} is {out[seed]} in one variant's run and {value} in "
                                 f"{r.variant}'s; the baseline must not depend on the variant")
            out[seed] = value
    return out


def headline(table: list[Row], variant: str) -> Headline | None:
    """``variant``'s ``Headline`` over the seeds where both its test accuracy and the baseline's are
    known; None below two such seeds (no interval)."""
    row = next(r for r in table if r.variant == variant)
    after, before = row.values.get(TEST, {}), baseline_by_seed(table)
    seeds = tuple(sorted(set(after) & set(before)))
    if len(seeds) < 2:
        return None

    def mean_of(values: dict[int, float]) -> float | None:
        found = [values[s] for s in seeds if s in values]
        return statistics.fmean(found) if found else None

    return Headline(variant, seeds, paired_test([before[s] for s in seeds]), paired_test([after[s] for s in seeds]),
                    mean_of(baseline_by_seed(table, N_EFF_BEFORE)), mean_of(row.values.get(N_EFF_AFTER, {})),
                    mean_of(row.values.get(ROWS, {})))


def _interval(t: PairedTest) -> str:
    return f"{t.mean:.3f} [{t.low:.3f}, {t.high:.3f}]"


def _headline_table(table: list[Row], pick: str | None) -> list[str]:
    """Every variant's ``Headline`` (the decision's pick in bold), one row each."""
    found = [h for r in table if (h := headline(table, r.variant))]
    if not found:
        return []
    lines = ["Test accuracy before and after, means over seeds with their 95% t intervals across seeds (one "
             "method both sides; a seed draws its own splits and is one unit); effective n per seed: "
             "n / design effect with operand multisets as clusters:", "",
             "| variant | seeds | before | after | effective n before / after (of rows) |", "|---|---|---|---|---|"]
    for h in found:
        name = f"**{h.variant}**" if h.variant == pick else h.variant
        n_eff = f"{_f(h.n_eff_before, digits=0)} / {_f(h.n_eff_after, digits=0)} (of {_f(h.rows, digits=0)})"
        lines.append(f"| {name} | {len(h.seeds)} | {_interval(h.before)} | {_interval(h.after)} | {n_eff} |")
    return lines


def _acting_per_seed(grid: Grid, table: list[Row]) -> list[str]:
    """Where the entropy rule acted, seed by seed: archer's band (the high-entropy tokens whose ratio
    lies beyond the ordinary clip but inside archer's wider one: their fraction and their share of
    the policy gradient) and a dropping rule's kept tokens' share; rows only for variants that log them."""
    keys = ((BAND, "wide-clip tokens in the band"), (BAND_SHARE, "their gradient share"),
            (KEPT_SHARE, "kept tokens' gradient share"), (CLIP_ACTING, "tokens clipped, of those that can act"),
            (BAND_ACTING, "wide-clip tokens in the band, of those that can act"),
            (ZERO_ADV, "update rows of zero advantage"), (KEPT, "kept fraction of the valid tokens"))
    lines = [f"| variant | measure | seeds {', '.join(map(str, grid.seeds))} |", "|---|---|---|"]
    for r in table:
        for key, label in keys:
            if values := r.values.get(key):
                lines.append(f"| {r.variant} | {label} | {' / '.join(_f(values.get(s), digits=4) for s in grid.seeds)} |")
    return lines if len(lines) > 2 else []


def forest_plot(grid: Grid, table: list[Row], path: Path) -> None:
    """Paired differences to each variant's partner (``Grid.partner``: the reference unless
    ``paired_with`` names another) with their 95% intervals (validation and test), one row per
    variant labelled with both names, the per-seed differences as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = [r for r in table if r.variant != grid.reference]
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.45 * len(others) + 1.6), sharey=True)
    for ax, key, title in ((axes[0], SELECT, "validation, last step"), (axes[1], TEST, "test accuracy")):
        for y, r in enumerate(reversed(others)):
            p = r.compared.get(key)
            if p is None or p.test is None:
                continue
            if p.test.low is not None:
                ax.plot([p.test.low, p.test.high], [y, y], color="tab:blue", lw=2)
            ax.plot(p.test.mean, y, "s", color="tab:blue")
            ax.plot(p.diffs, [y] * len(p.diffs), "o", color="gray", alpha=0.5, ms=4)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_title(f"{title}: variant - its partner", fontsize=10)
        ax.set_xlabel("paired difference (mean, 95% interval; dots: seeds)", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(others)), [f"{r.variant} - {grid.partner(r.variant)}" for r in reversed(others)])
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ---------------------------------------------------------------- commands
def stale_tasks(status: str) -> list[str]:
    """The tasks ``dvc queue status`` (its text) lists as running while no worker is active: a queue
    whose worker died (killed, or the machine stopped) leaves them so, and ``plan`` would take them
    as still waiting."""
    if "Worker status: 0 active" not in status:
        return []
    return [line.split()[0] for line in status.splitlines() if line.split()[-1:] == ["Running"]]


def clear_stale(root: Path) -> list[str]:
    """Kill and remove ``stale_tasks`` from the queue (their experiments are then queued again)."""
    stale = stale_tasks(dvc(root, ["queue", "status"]).stdout)
    if stale:
        print(f"ablations: {', '.join(stale)}: left running by a queue that stopped; removed, to be queued again",
              flush=True)
        dvc(root, ["queue", "kill", *stale])
        dvc(root, ["queue", "remove", *stale])
    return stale


def run_by_seed(root: Path, grid: Grid, queue: list[tuple[str, int]]) -> bool:
    """Queue and run ``queue`` one seed at a time, each seed's shared stages (``grpo.evaluation.seed_stages``) run
    once in the workspace first; the workspace's params and lock are put back after. False when an
    experiment could not be queued."""
    stages = read_stages(root / DVC_YAML) if (root / DVC_YAML).exists() else {}
    shared = seed_stages.shared_stages(stages, {k for over in grid.variants.values() for k in over})
    files = seed_stages.touched_files(root, stages, shared) if shared else []
    if shared:
        seed_stages.check_clean(root, files)
        print(f"ablations: {', '.join(shared)} run once per seed in the workspace (no variant sets their params)",
              flush=True)
    try:
        for seed in dict.fromkeys(s for _, s in queue):
            if shared:
                seed_stages.prepare_seed(root, grid.seed_keys, seed, shared)
            for variant in [v for v, s in queue if s == seed]:
                cmd = queue_args(grid, variant, seed)
                print("dvc " + " ".join(cmd), flush=True)
                if dvc(root, cmd, capture=False).returncode != 0:
                    print(f"ablations: error: queueing {exp_name(variant, seed)} failed", file=sys.stderr)
                    return False
            dvc(root, ["exp", "run", "--run-all", "--jobs", "1"], capture=False)
    finally:
        if shared and (warning := seed_stages.restore(root, files, shared)):
            print(warning, file=sys.stderr)
    return True


def _run(args: argparse.Namespace) -> int:
    root, grid = Path(args.root), load_grid(Path(args.root) / args.grid)
    clear_stale(root)
    record = Path(args.record) if args.record else None
    todo = plan(grid, record_runs(record).get(TEST, []) + read_runs(root, TEST))
    print(f"ablations: {len(todo.done)} finished, {len(todo.waiting)} waiting in the queue, "
          f"{len(todo.queue)} to queue ({len(todo.failed)} of them failed before)", flush=True)
    if todo.failed:
        dvc(root, ["queue", "remove", *todo.failed])
    if todo.waiting:  # queued by an earlier call: as they were queued
        dvc(root, ["exp", "run", "--run-all", "--jobs", "1"], capture=False)
    if todo.queue and not run_by_seed(root, grid, todo.queue):
        return 1
    left = plan(grid, record_runs(record).get(TEST, []) + read_runs(root, TEST))
    if left.queue or left.waiting:
        names = [exp_name(v, s) for v, s in left.queue] + left.waiting
        print(f"ablations: error: not finished: {', '.join(names)}; see `dvc queue status`", file=sys.stderr)
        return 1
    print(f"ablations: all {len(left.done)} experiments finished", flush=True)
    return _compare(args)


def cpu_kind() -> str:
    """The CPU's model name and whether it has ``avx512_bf16`` (bf16 or float32 stages): results of
    one grid are comparable only within one kind."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown"
    name = next((line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("model name")), "?")
    return f"{name}, {'avx512_bf16' if 'avx512_bf16' in info else 'no avx512_bf16'}"


def record_runs(path: Path | None) -> dict[str, list[Run]]:
    """The finished experiments a committed record holds (``--record``, written by ``compare``), as
    ``dvc exp show`` would list them, per metric: a grid that outlives one workspace goes on where
    it stopped. A record from another CPU kind is refused (its results would not pair)."""
    if path is None or not path.exists():
        return {}
    rec = json.loads(path.read_text())
    if rec.get("cpu") != cpu_kind():
        raise ValueError(f"{path}: recorded on {rec.get('cpu')!r}, this is {cpu_kind()!r}; "
                         "run the grid on that kind of CPU, or start a new record")
    return {key: [Run(name, "record", "success", {}, value) for name, value in per.items()]
            for key, per in rec["values"].items()}


def write_record(path: Path, grid: Grid, runs: dict[str, list[Run]]) -> None:
    """Every finished experiment of the grid with its ``METRICS``, and the CPU kind they ran on."""
    names = {exp_name(v, s) for v in grid.variants for s in grid.seeds}
    values = {key: {r.name: r.metric for r in found if r.name in names and r.metric is not None
                    and r.state in (None, "success")} for key, found in runs.items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": cpu_kind(), "values": values}, indent=1, sort_keys=True) + "\n")


def from_commit(root: Path, run: Run, metric: str) -> Run:
    """``run`` with ``metric`` ("<file>:<key>") read from the file its experiment committed, when
    ``dvc exp show`` does not list that file (a stage output that is not a declared metric, such as
    ``metrics/train.json``) and the experiment finished."""
    if run.metric is not None or run.state not in (None, "success") or not run.rev:
        return run
    file, _, key = metric.rpartition(":")
    proc = subprocess.run(["git", "show", f"{run.rev}:{file}"], cwd=root, capture_output=True, text=True)
    if proc.returncode != 0:
        return run
    value = json.loads(proc.stdout).get(key)
    return Run(run.name, run.rev, run.state, run.params, float(value) if value is not None else None)


def read_all(root: Path, record: Path | None) -> dict[str, list[Run]]:
    """Per metric of ``METRICS``: the record's experiments, then one ``dvc exp show``'s (which win),
    each metric read from the experiment's own commit where ``dvc exp show`` does not list it."""
    show, recorded = exp_show(root), record_runs(record)
    return {key: recorded.get(key, []) + [from_commit(root, r, key) for r in parse_runs(show, key)]
            for key in METRICS}


def read_table(root: Path, grid: Grid, record: Path | None = None) -> list[Row]:
    """The grid's rows from the record and one ``dvc exp show`` of ``root``."""
    return rows(grid, read_all(root, record))


def headline_pick(grid: Grid, table: list[Row]) -> str | None:
    """The variant the headline stands for: the decision's pick; in a grid that ``confirms`` another's
    decision, its one variant; else None."""
    if grid.decision:
        return choose(grid, table)[0]
    return next(iter(grid.variants)) if grid.confirms else None


def write_headlines(path: Path, grid_file: str, grid: Grid, table: list[Row]) -> None:
    """Every variant's ``headline`` with its overrides and the decision's pick, in the layout
    ``grpo.evaluation.seed_headline`` reads (the report shows the entry its run's params match)."""
    pick = headline_pick(grid, table)

    def side(t: PairedTest) -> dict[str, float | None]:
        return {"mean": t.mean, "low": t.low, "high": t.high}

    variants = {r.variant: {"overrides": r.overrides, "seeds": h.seeds, "before": side(h.before), "after": side(h.after),
                            "n_eff_before": h.n_eff_before, "n_eff_after": h.n_eff_after, "rows": h.rows}
                for r in table if (h := headline(table, r.variant))}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"cpu": cpu_kind(), "grid": grid_file, "chosen": pick, "confirms": grid.confirms,
                                "variants": variants},
                               indent=1, default=list) + "\n")


def _compare(args: argparse.Namespace) -> int:
    root, grid = Path(args.root), load_grid(Path(args.root) / args.grid)
    record = Path(args.record) if args.record else None
    runs = read_all(root, record)
    table = rows(grid, runs)
    if record:
        write_record(record, grid, runs)
    out = root / args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(grid, table)
    (out / "ablations.md").write_text(text)
    (out / "ablations.json").write_text(json.dumps([
        {"variant": r.variant, "overrides": r.overrides, "values": r.values,
         "compared": {k: {"seeds": p.seeds, "diffs": p.diffs, "p": p.test.p if p.test else None,
                          "p_holm": p.p_holm, "verdict": p.verdict} for k, p in r.compared.items()},
         "headline": asdict(h) if (h := headline(table, r.variant)) else None}
        for r in table], indent=1, default=list) + "\n")
    forest_plot(grid, table, out / "ablations.png")
    if args.headline:
        write_headlines(Path(args.headline), args.grid, grid, table)
    print(text, end="")
    print(f"(written to {args.out_dir}/ablations.md, .json, .png)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.evaluation.ablations", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=".", help="the DVC workspace (default: .)")
    common.add_argument("--grid", default=GRID, help=f"the grid file, relative to --root (default: {GRID})")
    common.add_argument("--record", help="a JSON file of finished experiments, read first and rewritten by "
                        "compare: commit it and the grid goes on in another clone")
    common.add_argument("--out-dir", default=OUT_DIR, help=f"the comparison's folder, relative to --root (default: {OUT_DIR})")
    common.add_argument("--headline", help="write every variant's seed-mean headline to this JSON file "
                        f"(the report reads {seed_headline.PATH})")
    sub.add_parser("run", parents=[common], help="queue the grid's missing experiments, run them one at a time, compare")
    sub.add_parser("compare", parents=[common], help="paired differences to the reference, table and plot")
    args = parser.parse_args(argv)
    try:
        return _run(args) if args.command == "run" else _compare(args)
    except (ValueError, RuntimeError, OSError) as err:
        print(f"ablations: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
