"""Ablations: a declared grid of variants run as DVC experiments over seeds, compared in pairs.

    python -m grpo.ablations run      [--grid experiments/ablations.yaml] [--out-dir outputs/ablations]
    python -m grpo.ablations compare  [--grid ...] [--out-dir ...]   # the comparison alone

The grid file names a ``reference`` variant, the ``seeds`` and ``variants``: name -> params overrides
(``{"train.order": "shuffled"}``), each checked against ``grpo.config`` before anything is queued;
optionally a ``second_reference`` variant, whose paired difference gets a column of its own.
Variant ``v`` with seed ``s`` is the experiment ``v-seed-s``: ``dvc exp run --queue -S
train.seed=s -S <overrides> -n v-seed-s``, queued seed by seed (every variant of seed 0 first, so a
run cut short still leaves pairs). ``run`` reads ``dvc exp show`` first and queues only the
experiments that have no result and are not waiting in the queue (failed ones are removed from
the queue and queued again; tasks left "running" by a worker that died are removed first:
``clear_stale``), then runs the queue with one worker (``dvc exp run --run-all --jobs 1``): a
second call after a finished run queues nothing and runs nothing. Once every experiment has a
result, ``run`` compares them (below), so one command does the whole grid.

``compare`` pairs each variant with the reference on the seeds both finished: the difference
``d_s = metric(v, s) - metric(reference, s)`` per seed, its mean and a 95% t-interval
(``mean +- t(0.975, n - 1) sd(d) / sqrt(n)``). Pairing by seed removes what the seed does to both
runs alike (the data order of the shuffled stages, the rollouts' sampling), so the interval is
about the variant, not the seed. An interval that spans zero reads "no detectable difference".
It writes ``ablations.md`` (the table), ``ablations.json`` and ``ablations.png`` (a forest plot of
the paired differences, test and validation) into ``--out-dir``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grpo.experiments import SEED_KEY, Run, cli_value, dvc, read_runs, t975

GRID = "experiments/ablations.yaml"
OUT_DIR = "outputs/ablations"
TEST = "metrics/final.json:accuracy"
VALIDATION = "metrics/train.json:best_val_accuracy"  # the shipped adapter's validation accuracy


@dataclass(frozen=True)
class Grid:
    """A declared ablation grid (the contract of ``experiments/ablations.yaml``)."""

    reference: str
    seeds: tuple[int, ...]
    variants: dict[str, dict[str, object]]  # name -> {"train.order": "shuffled", ...}
    second_reference: str | None = None  # a second column of paired differences (the table only)


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
    from grpo.config import ParamsError, params_from_dict

    tree = json.loads(json.dumps(params))
    try:
        for key, value in overrides.items():
            _set_dotted(tree, key, value)
        params_from_dict(tree)
    except (ValueError, ParamsError) as err:
        raise ValueError(f"variant {name!r}: {err}") from None


def load_grid(path: Path, params_path: Path | None = None) -> Grid:
    """The grid in ``path``; every variant's overrides validated over ``params_path`` (params.yaml
    beside the grid's repository by default) so that a typo fails here, not an hour into a queue."""
    from grpo.config import read_params_yaml

    raw = read_params_yaml(path)  # a repeated key or bad YAML: one line naming the file and line
    variants = raw.get("variants") or {}
    if not isinstance(variants, dict) or not variants:
        raise ValueError(f"{path}: 'variants' must map variant names to params overrides")
    reference = raw.get("reference")
    if reference not in variants:
        raise ValueError(f"{path}: reference {reference!r} is not one of the variants ({', '.join(variants)})")
    second = raw.get("second_reference")
    if second is not None and (second not in variants or second == reference):
        raise ValueError(f"{path}: second_reference {second!r} is not one of the other variants")
    seeds = raw.get("seeds")
    if not isinstance(seeds, list) or not seeds or not all(isinstance(s, int) for s in seeds) \
            or len(set(seeds)) != len(seeds):
        raise ValueError(f"{path}: 'seeds' must be a list of distinct integers")
    grid = Grid(reference=reference, seeds=tuple(seeds),
                variants={name: dict(over or {}) for name, over in variants.items()}, second_reference=second)
    params = read_params_yaml(params_path or Path(path).resolve().parent.parent / "params.yaml")
    for name, overrides in grid.variants.items():
        if SEED_KEY in overrides:
            raise ValueError(f"variant {name!r}: {SEED_KEY} is set per experiment by the grid's seeds")
        check_overrides(name, overrides, params)
    return grid


def exp_name(variant: str, seed: int) -> str:
    return f"{variant}-seed-{seed}"


def queue_args(grid: Grid, variant: str, seed: int) -> list[str]:
    """The ``dvc`` arguments that queue ``variant`` with ``seed``."""
    sets = [arg for key, value in grid.variants[variant].items() for arg in ("-S", f"{key}={cli_value(value)}")]
    return ["exp", "run", "--queue", "-S", f"{SEED_KEY}={seed}", *sets, "-n", exp_name(variant, seed)]


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
    by_name = {r.name: r for r in runs}
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
    """A variant against the reference on the seeds both have."""

    seeds: tuple[int, ...]
    diffs: tuple[float, ...]  # variant - reference, per seed
    mean: float | None
    low: float | None  # 95% t-interval; None below 2 pairs
    high: float | None

    @property
    def verdict(self) -> str:
        if self.low is None:
            return "too few seeds"
        if self.low <= 0 <= self.high:
            return "no detectable difference"
        return "better" if self.low > 0 else "worse"


def paired(reference: dict[int, float], variant: dict[int, float]) -> Paired:
    """Per-seed differences ``variant - reference`` over the seeds in both, their mean and 95%
    t-interval (n - 1 degrees of freedom)."""
    seeds = tuple(sorted(set(reference) & set(variant)))
    diffs = tuple(variant[s] - reference[s] for s in seeds)
    if not diffs:
        return Paired(seeds, diffs, None, None, None)
    mean = statistics.fmean(diffs)
    if len(diffs) < 2:
        return Paired(seeds, diffs, mean, None, None)
    half = t975(len(diffs) - 1) * statistics.stdev(diffs) / math.sqrt(len(diffs))
    return Paired(seeds, diffs, mean, mean - half, mean + half)


def detectable(diffs_sd: float, n: int) -> float:
    """The smallest mean paired difference whose 95% interval excludes zero with ``n`` seeds when
    the per-seed differences have standard deviation ``diffs_sd``: ``t(0.975, n - 1) sd / sqrt(n)``."""
    return t975(n - 1) * diffs_sd / math.sqrt(n)


def values_by_variant(grid: Grid, runs: list[Run]) -> dict[str, dict[int, float]]:
    """``{variant: {seed: metric}}`` of the finished experiments named after the grid (a queued or
    running one shows its baseline's metrics in ``dvc exp show``: not counted)."""
    by_name = {r.name: r for r in runs if r.metric is not None and r.state in (None, "success")}
    return {v: {s: by_name[exp_name(v, s)].metric for s in grid.seeds if exp_name(v, s) in by_name}
            for v in grid.variants}


@dataclass(frozen=True)
class Row:
    variant: str
    overrides: dict[str, object]
    test: dict[int, float]
    validation: dict[int, float]
    test_paired: Paired
    validation_paired: Paired


def rows(grid: Grid, test_runs: list[Run], val_runs: list[Run]) -> list[Row]:
    test, val = values_by_variant(grid, test_runs), values_by_variant(grid, val_runs)
    return [Row(v, grid.variants[v], test[v], val[v], paired(test[grid.reference], test[v]),
                paired(val[grid.reference], val[v])) for v in grid.variants]


def _f(x: float | None, signed: bool = False) -> str:
    return "-" if x is None else (f"{x:+.3f}" if signed else f"{x:.3f}")


def _interval(p: Paired) -> str:
    return f"{_f(p.mean, True)} [{_f(p.low, True)}, {_f(p.high, True)}]" if p.low is not None else _f(p.mean, True)


def _split_table(grid: Grid, table: list[Row], split: str) -> list[str]:
    """One split's table, what a reader needs first (a phone shows the first columns): per variant
    the verdict and the paired difference to the reference with its 95% interval, the mean, the
    metric per seed in one cell, and what the variant changes (keys without their section). With a
    ``second_reference``, the paired difference to it and its verdict follow the first's."""
    seeds, ref_name, second = grid.seeds, grid.reference, grid.second_reference
    head = ["variant", "verdict", f"minus {ref_name} [95%]", "mean", f"seeds {', '.join(map(str, seeds))}", "changes"]
    if second:
        head.insert(3, f"minus {second} [95%]")
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    split_values = {r.variant: r.test if split == "test" else r.validation for r in table}
    for r in table:
        values, pair = (r.test, r.test_paired) if split == "test" else (r.validation, r.validation_paired)
        changes = ", ".join(f"`{k.rpartition('.')[2]}={cli_value(v)}`" for k, v in r.overrides.items())
        ref = r.variant == ref_name
        cells = [f"**{r.variant}**" if ref else r.variant, "reference" if ref else pair.verdict,
                 "" if ref else _interval(pair), _f(statistics.fmean(values.values()) if values else None),
                 " / ".join(_f(values.get(s)) for s in seeds), changes or "params.yaml"]
        if second:
            to_second = paired(split_values.get(second, {}), values)
            cells.insert(3, "" if r.variant == second else f"{_interval(to_second)}: {to_second.verdict}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def markdown(grid: Grid, table: list[Row]) -> str:
    """The comparison: the test table, the validation table, then what the design can detect."""
    lines = ["Test accuracy (n = 225 problems, greedy):", "", *_split_table(grid, table, "test"), "",
             "Validation accuracy of the shipped adapter (the split the default is chosen on):", "",
             *_split_table(grid, table, "validation")]
    sds = [statistics.stdev(r.test_paired.diffs) for r in table
           if r.variant != grid.reference and len(r.test_paired.diffs) >= 2]
    if sds:
        n = max(len(r.test_paired.diffs) for r in table if r.variant != grid.reference)
        sd = math.sqrt(statistics.fmean(x * x for x in sds))
        lines += ["", f"With {n} seeds a mean paired difference is told from zero when it exceeds "
                  f"t(0.975, {n - 1}) sd(d) / sqrt({n}) = {t975(n - 1) / math.sqrt(n):.2f} sd(d); with sd(d) "
                  f"pooled over the variants ({sd:.3f}) that is **{detectable(sd, n):.3f}** of test accuracy."]
    return "\n".join(lines) + "\n"


def forest_plot(grid: Grid, table: list[Row], path: Path) -> None:
    """Paired differences to the reference with their 95% intervals (test and validation), one row
    per variant, the per-seed differences as dots."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = [r for r in table if r.variant != grid.reference]
    fig, axes = plt.subplots(1, 2, figsize=(9, 0.45 * len(others) + 1.6), sharey=True)
    for ax, attr, title in ((axes[0], "test_paired", "test accuracy"), (axes[1], "validation_paired", "validation accuracy")):
        for y, r in enumerate(reversed(others)):
            p: Paired = getattr(r, attr)
            if p.low is not None:
                ax.plot([p.low, p.high], [y, y], color="tab:blue", lw=2)
            if p.mean is not None:
                ax.plot(p.mean, y, "s", color="tab:blue")
            ax.plot(p.diffs, [y] * len(p.diffs), "o", color="gray", alpha=0.5, ms=4)
        ax.axvline(0, color="black", lw=0.8)
        ax.set_title(f"{title}: variant - {grid.reference}", fontsize=10)
        ax.set_xlabel("paired difference (mean, 95% interval; dots: seeds)", fontsize=8)
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(range(len(others)), [r.variant for r in reversed(others)])
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


def _run(args: argparse.Namespace) -> int:
    root, grid = Path(args.root), load_grid(Path(args.root) / args.grid)
    clear_stale(root)
    todo = plan(grid, read_runs(root, TEST))
    print(f"ablations: {len(todo.done)} finished, {len(todo.waiting)} waiting in the queue, "
          f"{len(todo.queue)} to queue ({len(todo.failed)} of them failed before)", flush=True)
    if todo.failed:
        dvc(root, ["queue", "remove", *todo.failed])
    for variant, seed in todo.queue:
        cmd = queue_args(grid, variant, seed)
        print("dvc " + " ".join(cmd), flush=True)
        if dvc(root, cmd, capture=False).returncode != 0:
            print(f"ablations: error: queueing {exp_name(variant, seed)} failed", file=sys.stderr)
            return 1
    if todo.queue or todo.waiting:
        dvc(root, ["exp", "run", "--run-all", "--jobs", "1"], capture=False)
    left = plan(grid, read_runs(root, TEST))
    if left.queue or left.waiting:
        names = [exp_name(v, s) for v, s in left.queue] + left.waiting
        print(f"ablations: error: not finished: {', '.join(names)}; see `dvc queue status`", file=sys.stderr)
        return 1
    print(f"ablations: all {len(left.done)} experiments finished", flush=True)
    return _compare(args)


def _compare(args: argparse.Namespace) -> int:
    root, grid = Path(args.root), load_grid(Path(args.root) / args.grid)
    table = rows(grid, read_runs(root, TEST), read_runs(root, VALIDATION))
    out = root / args.out_dir
    out.mkdir(parents=True, exist_ok=True)
    text = markdown(grid, table)
    (out / "ablations.md").write_text(text)
    (out / "ablations.json").write_text(json.dumps([
        {"variant": r.variant, "overrides": r.overrides, "test": r.test, "validation": r.validation,
         "test_paired": r.test_paired.__dict__, "validation_paired": r.validation_paired.__dict__}
        for r in table], indent=1, default=list) + "\n")
    forest_plot(grid, table, out / "ablations.png")
    print(text, end="")
    print(f"(written to {args.out_dir}/ablations.md, .json, .png)")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m grpo.ablations", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--root", default=".", help="the DVC workspace (default: .)")
    common.add_argument("--grid", default=GRID, help=f"the grid file, relative to --root (default: {GRID})")
    common.add_argument("--out-dir", default=OUT_DIR, help=f"the comparison's folder, relative to --root (default: {OUT_DIR})")
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
