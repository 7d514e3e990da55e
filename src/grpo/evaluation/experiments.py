"""Seed sweeps as DVC experiments, and their comparison across seeds.

One training run is one draw: the same params with another ``train.seed`` end elsewhere (README
"Experiments and seeds" has the default's sweep). This module queues the same params over several
seeds and summarises a metric per set of params across them.

    python -m grpo.evaluation.experiments queue --name lr5e-4 --seeds 0 1 2 -S train.optimizer.lr=5e-4 [--run --jobs 1]
    python -m grpo.evaluation.experiments compare [--metric metrics/headline.json:test_accuracy_after] [--ignore 'train.wandb_*']
    python -m grpo.evaluation.experiments table   # the experiments of HEAD: accuracies and what each changed, narrow

``queue`` runs, per seed N, ``dvc exp run --queue -S train.seed=N [-S <extra> ...] -n <name>-seed-N``;
with ``--run`` it then runs ``dvc exp run --run-all --jobs J``, which starts J queue workers (as
``dvc queue start -j J``) and follows every queued experiment to its end.

``compare`` reads ``dvc exp show --json`` (the experiments of HEAD; ``--all-commits`` for every
commit's), keeps the experiments that finished with the metric, groups them by all their params
except the seed key and the ``--ignore`` patterns (names are never params), and prints per group:
the params that tell the groups apart, n, the seeds, the mean, a 95% t-interval across seeds
(mean +- t(0.975, n - 1) s / sqrt(n), s the sample standard deviation; none for n = 1), min and
max. The same table goes to ``--out`` as markdown. The workspace and commit rows of ``dvc exp
show`` are not experiments and are left out.

``table`` is ``dvc exp show`` made narrow: one row for the commit and one per finished
experiment, with the test accuracy before and after training, the validation accuracy
(``HEADLINE``) and the params the experiment changed from the commit's, as ``key=value`` in one
column (section names left out where the key alone is unique). ``dvc exp show`` gives every
changed param a column of its own, which outgrows 200 columns after a few ablations.

DVC runs in subprocesses (the library never imports it), with this interpreter's directory first
on ``PATH``: queue workers start ``dvc`` from ``PATH`` and the stages run ``python``.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

SEED_KEY = "train.seed"
METRIC = "metrics/headline.json:test_accuracy_after"
# The one declared metrics file is metrics/headline.json (written by the report stage); before it,
# the evaluation and train summaries were declared metrics. A metric named either way is found in
# an experiment of either kind (the validation accuracy: of the shipped adapter, which is the best
# one with the default train.checkpoints.keep_best).
SAME_METRIC = {"metrics/final.json:accuracy": "metrics/headline.json:test_accuracy_after",
               "metrics/baseline.json:accuracy": "metrics/headline.json:test_accuracy_before",
               "metrics/train.json:best_val_accuracy": "metrics/headline.json:val_accuracy"}
SAME_METRIC |= {new: old for old, new in SAME_METRIC.items()}
HEADLINE = (("test before", "metrics/headline.json:test_accuracy_before"),
            ("test after", "metrics/headline.json:test_accuracy_after"),
            ("val", "metrics/headline.json:val_accuracy"))
"""The columns of ``table``: header -> metric."""
# Not under reports/: that directory is the report stage's output, and a file DVC did not write
# there would mark the stage changed (and be deleted when it re-runs).
OUT = "outputs/seeds.md"

def t975(df: int) -> float:
    """The 0.975 quantile of Student's t with ``df`` degrees of freedom (scipy's)."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    from scipy.stats import t

    return float(t.ppf(0.975, df))


@dataclass(frozen=True)
class Summary:
    """A metric across the seeds of one group."""

    n: int
    mean: float
    low: float | None  # the 95% t-interval; None for n = 1
    high: float | None
    min: float
    max: float


def summarize(values: list[float]) -> Summary:
    """Mean, 95% t-interval (n - 1 degrees of freedom), min and max of ``values`` (at least one)."""
    if not values:
        raise ValueError("no values to summarize")
    n, mean = len(values), statistics.fmean(values)
    if n == 1:
        low = high = None
    else:
        half = t975(n - 1) * statistics.stdev(values) / math.sqrt(n)
        low, high = mean - half, mean + half
    return Summary(n=n, mean=mean, low=low, high=high, min=min(values), max=max(values))


@dataclass(frozen=True)
class Run:
    """One experiment of ``dvc exp show --json``."""

    name: str
    rev: str
    state: str | None  # its queue task's state (success, failed, queued, running); None if it ran in the workspace
    params: dict[str, object]  # params.yaml keys as "train.optimizer.lr"; other params files' as "<file>:<key>"
    metric: float | None  # None when the experiment has not written it (queued, running, failed)


def flat_params(files: dict) -> dict[str, object]:
    """``{"train.optimizer.lr": 5e-4, ...}`` from the ``params`` of one ``dvc exp show --json`` entry: nested
    mappings flattened with dots (as ``-S`` names them), lists kept whole."""
    out: dict[str, object] = {}

    def walk(tree: dict, prefix: str) -> None:
        for key, value in tree.items():
            if isinstance(value, dict):
                walk(value, f"{prefix}{key}.")
            else:
                out[f"{prefix}{key}"] = value

    for file, entry in (files or {}).items():
        walk((entry or {}).get("data") or {}, "" if file == "params.yaml" else f"{file}:")
    return out


def metric_value(metrics: dict, metric: str) -> float | None:
    """The value of ``metric`` ("<file>:<dotted key>", or a key looked up in every metrics file), or
    of its ``SAME_METRIC`` counterpart when the experiment does not declare it."""
    value = _metric_value(metrics, metric)
    if value is None and metric in SAME_METRIC:
        value = _metric_value(metrics, SAME_METRIC[metric])
    return value


def _metric_value(metrics: dict, metric: str) -> float | None:
    file, _, key = metric.rpartition(":")
    for name, entry in (metrics or {}).items():
        if file and name != file:
            continue
        node = (entry or {}).get("data")
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if isinstance(node, (int, float)) and not isinstance(node, bool):
            return float(node)
    return None


def parse_runs(show: list[dict], metric: str = METRIC) -> list[Run]:
    """The experiments in ``dvc exp show --json`` output (every baseline's), in its order."""
    runs = []
    for baseline in show or []:
        for exp in baseline.get("experiments") or []:
            executor = exp.get("executor") or {}
            for rev in (exp.get("revs") or [])[:1]:  # one rev per experiment in DVC 3
                data = rev.get("data") or {}
                runs.append(Run(name=exp.get("name") or rev.get("name") or rev.get("rev", "")[:7],
                                rev=rev.get("rev", ""), state=executor.get("state"),
                                params=flat_params(data.get("params")),
                                metric=metric_value(data.get("metrics"), metric) if not rev.get("error") else None))
    return runs


@dataclass(frozen=True)
class Group:
    """Experiments with the same params but for the ignored ones."""

    params: dict[str, object]
    runs: tuple[Run, ...]
    summary: Summary


def _ignored(key: str, ignore: list[str]) -> bool:
    return any(fnmatch.fnmatchcase(key, pattern) for pattern in ignore)


def group_runs(runs: list[Run], ignore: list[str]) -> list[Group]:
    """Runs with a metric, grouped by their params except those matching ``ignore`` (fnmatch
    patterns); groups ordered by mean, best first."""
    buckets: dict[str, list[Run]] = {}
    for run in runs:
        if run.metric is None:
            continue
        kept = {k: v for k, v in run.params.items() if not _ignored(k, ignore)}
        buckets.setdefault(json.dumps(kept, sort_keys=True, default=str), []).append(run)
    groups = [Group(params=json.loads(key), runs=tuple(members), summary=summarize([r.metric for r in members]))
              for key, members in buckets.items()]
    return sorted(groups, key=lambda g: (-g.summary.mean, json.dumps(g.params, sort_keys=True)))


def differing(groups: list[Group]) -> list[str]:
    """Params keys whose values are not the same in every group (missing counts as a value)."""
    keys = sorted({k for g in groups for k in g.params})
    return [k for k in keys if len({json.dumps(g.params.get(k, "<unset>"), default=str) for g in groups}) > 1]


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.4f}"


def _seed_order(seed: object) -> tuple:
    return (0, seed, "") if isinstance(seed, (int, float)) else (1, 0, str(seed))


def markdown(groups: list[Group], runs: list[Run], metric: str, seed_key: str, ignore: list[str]) -> str:
    """The comparison as markdown: one row per group, then the experiments left out and why."""
    keys = differing(groups)
    others = sorted(set(ignore) - {seed_key})
    lines = [f"Experiments grouped by params except `{seed_key}`"
             + (f" and {', '.join(f'`{p}`' for p in others)}" if others else "")
             + f"; `{metric}` across seeds: mean, 95% t-interval (n - 1 degrees of freedom), min, max.", ""]
    lines += ["| params | n | seeds | mean | 95% interval | min | max |", "|---|---|---|---|---|---|---|"]
    for g in groups:
        label = ", ".join(f"{k}={json.dumps(g.params[k]) if k in g.params else '(unset)'}" for k in keys)
        seeds = ", ".join(map(str, sorted((r.params.get(seed_key, "?") for r in g.runs), key=_seed_order)))
        s = g.summary
        interval = "-" if s.low is None else f"[{_fmt(s.low)}, {_fmt(s.high)}]"
        lines.append(f"| {label or '(all the same)'} | {s.n} | {seeds} | {_fmt(s.mean)} | {interval} | "
                     f"{_fmt(s.min)} | {_fmt(s.max)} |")
    if not groups:
        lines.append("| (no finished experiment with this metric) | 0 | | - | - | - | - |")
    left = [r for r in runs if r.metric is None]
    if left:
        lines += ["", "Not counted (no metric): " + ", ".join(f"{r.name} ({r.state or 'no value'})" for r in left)]
    return "\n".join(lines) + "\n"


def comparison(runs: list[Run], metric: str = METRIC, seed_key: str = SEED_KEY, ignore: list[str] | None = None,
               prefix: str = "") -> str:
    """The markdown of ``compare``: the runs named ``prefix``..., grouped by their params except
    ``seed_key`` and the ``ignore`` patterns."""
    runs = [r for r in runs if r.name.startswith(prefix)]
    ignore = [seed_key, *(ignore or [])]
    return markdown(group_runs(runs, ignore), runs, metric, seed_key, ignore)


def queue_commands(name: str, seeds: list[int], overrides: list[str] | None = None,
                   seed_key: str = SEED_KEY) -> list[list[str]]:
    """The ``dvc`` arguments that queue ``name``-seed-N for each seed, with the extra ``-S`` overrides."""
    overrides = list(overrides or [])
    if len(set(seeds)) != len(seeds):
        raise ValueError(f"seeds repeat: {seeds}")
    if any(o.split("=", 1)[0].strip() in (seed_key, f"params.yaml:{seed_key}") for o in overrides):
        raise ValueError(f"{seed_key} is set per experiment by --seeds; leave it out of the overrides")
    extra = [arg for o in overrides for arg in ("-S", o)]
    return [["exp", "run", "--queue", "-S", f"{seed_key}={seed}", *extra, "-n", f"{name}-seed-{seed}"]
            for seed in seeds]


def dvc(root: Path, args: list[str], capture: bool = True) -> subprocess.CompletedProcess:
    """``python -m dvc <args>`` in ``root`` with this interpreter's directory first on PATH."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=env, text=True, capture_output=capture)


def exp_show(root: Path, all_commits: bool = False) -> list[dict]:
    """``dvc exp show --json`` of ``root`` (HEAD's experiments; every commit's with ``all_commits``)."""
    proc = dvc(root, ["exp", "show", "--json", *(["--all-commits"] if all_commits else [])])
    if proc.returncode != 0:
        lines = [x for x in (proc.stderr or proc.stdout).splitlines() if x.strip()]
        raise RuntimeError("dvc exp show failed: " + (lines[-1].strip() if lines else f"exit code {proc.returncode}"))
    return json.loads(proc.stdout or "[]")


def read_runs(root: Path, metric: str = METRIC, all_commits: bool = False) -> list[Run]:
    """The experiments of ``dvc exp show --json`` in ``root``."""
    return parse_runs(exp_show(root, all_commits), metric)


@dataclass(frozen=True)
class Row:
    """One line of ``table``: an experiment (or the commit), its headline metrics, what it changed."""

    name: str
    metrics: tuple[float | None, ...]  # in HEADLINE's order
    params: dict[str, object]


def table_rows(show: list[dict]) -> list[Row]:
    """The commit of ``dvc exp show --json`` (its first baseline after the workspace) and its
    finished experiments, newest first as DVC lists them; queued, running and failed ones are left
    out."""
    out = []
    for baseline in show or []:
        if baseline.get("rev") == "workspace":
            continue
        data = baseline.get("data") or {}
        out.append(Row(baseline.get("name") or baseline.get("rev", "")[:7],
                       tuple(metric_value(data.get("metrics"), m) for _, m in HEADLINE), flat_params(data.get("params"))))
        for exp in baseline.get("experiments") or []:
            if (exp.get("executor") or {}).get("state") not in (None, "success"):
                continue
            for rev in (exp.get("revs") or [])[:1]:
                data = rev.get("data") or {}
                out.append(Row(exp.get("name") or rev.get("rev", "")[:7],
                               tuple(metric_value(data.get("metrics"), m) for _, m in HEADLINE),
                               flat_params(data.get("params"))))
        break
    return out


def short_keys(keys: list[str]) -> dict[str, str]:
    """``train.order`` -> ``order`` where no other key ends the same; else the whole key."""
    leaves = [k.rpartition(".")[2] for k in keys]
    return {k: leaf if leaves.count(leaf) == 1 else k for k, leaf in zip(keys, leaves, strict=True)}


def narrow_table(rows: list[Row], ignore: list[str] | None = None) -> str:
    """``table``'s text: aligned columns; the last one lists each row's params that differ from the
    first row's (the commit), ``--ignore`` patterns left out."""
    if not rows:
        return "no experiments\n"
    base = rows[0].params
    keys = sorted({k for r in rows for k, v in r.params.items() if base.get(k) != v and not _ignored(k, ignore or [])})
    names = short_keys(keys)
    head = ["experiment", *(h for h, _ in HEADLINE), "changed"]
    body = [[r.name, *(_fmt(m) for m in r.metrics),
             " ".join(f"{names[k]}={cli_value(r.params.get(k))}" for k in keys if r.params.get(k) != base.get(k))]
            for r in rows]
    widths = [max(len(row[i]) for row in [head, *body]) for i in range(len(head) - 1)]
    return "".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                   + "  " + row[-1] + "\n" for row in [head, *body])


def cli_value(value: object) -> str:
    """A params value as ``dvc exp run -S key=VALUE`` writes it: text as it is, else JSON."""
    return value if isinstance(value, str) else json.dumps(value)


def _queue(args: argparse.Namespace) -> int:
    root = Path(args.root)
    commands = queue_commands(args.name, args.seeds, args.set, args.seed_key)
    for cmd in commands:
        print("dvc " + " ".join(cmd), flush=True)
        proc = dvc(root, cmd, capture=False)
        if proc.returncode != 0:
            print(f"experiments: error: queueing {cmd[-1]} failed (exit code {proc.returncode})", file=sys.stderr)
            return proc.returncode
    if not args.run:
        print(f"queued {len(commands)} experiments; run them with `dvc queue start -j {args.jobs}` "
              f"(or `dvc exp run --run-all -j {args.jobs}` to wait), then `python -m grpo.evaluation.experiments compare`")
        return 0
    print(f"dvc exp run --run-all --jobs {args.jobs}", flush=True)
    dvc(root, ["exp", "run", "--run-all", "--jobs", str(args.jobs)], capture=False)
    names = {cmd[-1] for cmd in commands}
    runs = {r.name: r for r in read_runs(root, args.metric) if r.name in names}
    bad = sorted(n for n in names if n not in runs or runs[n].state not in (None, "success"))
    if bad:
        states = ", ".join(f"{n} ({runs[n].state if n in runs else 'not found'})" for n in bad)
        print(f"experiments: error: not finished: {states}; see `dvc queue status`, `dvc queue logs <name>`",
              file=sys.stderr)
        return 1
    return 0


def _compare(args: argparse.Namespace) -> int:
    runs = read_runs(Path(args.root), args.metric, args.all_commits)
    text = comparison(runs, args.metric, args.seed_key, args.ignore, args.prefix)
    out = Path(args.root) / args.out
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(text)
    print(text, end="")
    print(f"(written to {args.out})")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.evaluation.experiments", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=".", help="the DVC workspace (default: .)")
    common.add_argument("--seed-key", default=SEED_KEY, help=f"the params key of the seed (default: {SEED_KEY})")
    common.add_argument("--metric", default=METRIC, help=f"<metrics file>:<key> (default: {METRIC})")
    q = sub.add_parser("queue", parents=[common], help="queue the same params over several seeds")
    q.add_argument("--name", required=True, help="experiments are named <name>-seed-N")
    q.add_argument("--seeds", type=int, nargs="+", required=True)
    q.add_argument("-S", "--set", action="append", default=[], metavar="KEY=VALUE",
                   help="an extra params override for every seed, as in `dvc exp run -S` (repeatable)")
    q.add_argument("--run", action="store_true", help="then run the queue and wait for it (dvc exp run --run-all)")
    q.add_argument("-j", "--jobs", type=int, default=1, help="queue workers (default: 1)")
    c = sub.add_parser("compare", parents=[common], help="mean and 95%% interval of the metric across seeds")
    c.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                   help="params also left out of the grouping (fnmatch pattern, repeatable)")
    c.add_argument("--prefix", default="", help="only experiments whose name starts with this")
    c.add_argument("--all-commits", action="store_true", help="experiments of every commit, not only HEAD's")
    c.add_argument("--out", default=OUT, help=f"markdown file, relative to --root (default: {OUT})")
    t = sub.add_parser("table", help="the experiments of HEAD, narrow: accuracies and the params each changed")
    t.add_argument("--root", default=".", help="the DVC workspace (default: .)")
    t.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                   help="params left out of the changed column (fnmatch pattern, repeatable)")
    args = parser.parse_args(argv)
    try:
        if args.command == "table":
            print(narrow_table(table_rows(exp_show(Path(args.root))), args.ignore), end="")
            return 0
        return _queue(args) if args.command == "queue" else _compare(args)
    except (ValueError, RuntimeError) as err:
        print(f"experiments: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
