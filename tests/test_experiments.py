"""Seed sweeps (``grpo.evaluation.experiments``): queued as real DVC experiments, run by DVC's queue, compared
from the real ``dvc exp show --json``; the t quantiles against the t distribution itself."""

from __future__ import annotations

import math
import os
import statistics
import sys
from pathlib import Path

import pytest
import yaml

from grpo.evaluation import experiments
from grpo.evaluation.experiments import comparison, exp_show, group_runs, parse_runs, queue_commands, summarize, t975

from .helpers import git_dvc_init

# accuracy = lr * 10 + seed * lr: each group of seeds has its own mean and spread
STAGE_CMD = ("python -c \"import json, os, yaml; p = yaml.safe_load(open('params.yaml'))['train']; "
             "os.makedirs('metrics', exist_ok=True); "
             "lr = p['optimizer']['lr']; json.dump(dict(accuracy=lr * 10 + p['seed'] * lr, n=3), open('metrics/final.json', 'w'))\"")
LRS, SEEDS = (0.01, 0.02), (0, 1, 2)


def _t975_df2() -> float:
    """t(0.975, 2) in closed form: for 2 degrees of freedom the quantile of p is (2p - 1) / sqrt(2p(1 - p))."""
    p = 0.975
    return (2 * p - 1) / math.sqrt(2 * p * (1 - p))


def _expected(lr: float) -> tuple[float, float, float]:
    values = [lr * 10 + seed * lr for seed in SEEDS]
    mean = sum(values) / 3
    sd = math.sqrt(sum((v - mean) ** 2 for v in values) / 2)
    half = _t975_df2() * sd / math.sqrt(3)
    return mean, mean - half, mean + half


def test_queue_commands_one_experiment_per_seed_with_the_overrides():
    assert queue_commands("lr5e-4", [0, 1], ["train.optimizer.lr=5e-4", "train.steps=80"]) == [
        ["exp", "run", "--queue", "-S", "train.seed=0", "-S", "train.optimizer.lr=5e-4", "-S", "train.steps=80", "-n", "lr5e-4-seed-0"],
        ["exp", "run", "--queue", "-S", "train.seed=1", "-S", "train.optimizer.lr=5e-4", "-S", "train.steps=80", "-n", "lr5e-4-seed-1"],
    ]
    with pytest.raises(ValueError, match="train.seed"):
        queue_commands("x", [0], ["train.seed=3"])
    with pytest.raises(ValueError, match="repeat"):
        queue_commands("x", [0, 0])


def test_t975_is_the_t_quantile():
    assert t975(2) == pytest.approx(_t975_df2(), abs=1e-11)  # closed form at 2 degrees of freedom
    assert t975(1) == pytest.approx(12.70620473617, abs=1e-9) and t975(10**6) == pytest.approx(1.959966, abs=1e-5)
    with pytest.raises(ValueError):
        t975(0)


def test_summarize_one_value_has_no_interval():
    s = summarize([0.5])
    assert (s.n, s.mean, s.low, s.high, s.min, s.max) == (1, 0.5, None, None, 0.5, 0.5)
    s = summarize([0.1, 0.2, 0.3, 0.6])
    half = t975(3) * statistics.stdev([0.1, 0.2, 0.3, 0.6]) / 2
    assert (s.low, s.high) == pytest.approx((0.3 - half, 0.3 + half))


def test_metric_and_params_names():
    assert experiments.flat_params({"params.yaml": {"data": {"train": {"rewards": {"c": 1.0}, "l": [1], "optimizer": {"lr": 1}}}},
                                    "other.yaml": {"data": {"k": 2}}}) == {
        "train.optimizer.lr": 1, "train.rewards.c": 1.0, "train.l": [1], "other.yaml:k": 2}
    metrics = {"metrics/final.json": {"data": {"accuracy": 0.5, "ci": {"low": 0.4}}},
               "metrics/baseline.json": {"data": {"accuracy": 0.25}}}
    assert experiments.metric_value(metrics, "metrics/baseline.json:accuracy") == 0.25
    assert experiments.metric_value(metrics, "metrics/final.json:ci.low") == 0.4
    assert experiments.metric_value(metrics, "metrics/final.json:missing") is None
    assert experiments.metric_value({"m.json": {"error": {"type": "FileNotFoundError"}}}, "m.json:accuracy") is None
    # the headline file (declared since it exists) and the files declared before it name the same accuracies
    assert experiments.metric_value(metrics, "metrics/headline.json:test_accuracy_after") == 0.5
    assert experiments.metric_value(metrics, experiments.METRIC) == 0.5
    headline = {"metrics/headline.json": {"data": {"test_accuracy_before": 0.2, "test_accuracy_after": 0.7,
                                                   "val_accuracy": 0.8}}}
    assert [experiments.metric_value(headline, m) for m in ("metrics/baseline.json:accuracy", "metrics/final.json:accuracy",
                                                            "metrics/train.json:best_val_accuracy")] == [0.2, 0.7, 0.8]
    assert experiments.metric_value(headline, "metrics/final.json:n") is None


def _tiny_repo(path: Path) -> Path:
    path.mkdir()
    (path / "params.yaml").write_text(yaml.safe_dump({"train": {"seed": 0, "steps": 3, "optimizer": {"lr": 0.01}}}, sort_keys=False))
    stages = {"final_eval": {"cmd": STAGE_CMD, "params": ["train"],
                             "metrics": [{"metrics/final.json": {"cache": False}}]}}
    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    return git_dvc_init(path)


@pytest.mark.slow
def test_seed_sweep_through_the_dvc_queue_and_its_comparison(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")  # the stage's python
    repo = _tiny_repo(tmp_path / "repo")

    # 3 seeds x 2 learning rates: two queue commands, the second one runs the queue and waits
    assert experiments.main(["queue", "--root", str(repo), "--name", "lr0.01", "--seeds", *map(str, SEEDS),
                             "-S", "train.optimizer.lr=0.01"]) == 0
    assert experiments.main(["queue", "--root", str(repo), "--name", "lr0.02", "--seeds", *map(str, SEEDS),
                             "-S", "train.optimizer.lr=0.02", "--run", "--jobs", "1"]) == 0
    capfd.readouterr()

    show = exp_show(repo)  # the real `dvc exp show --json`
    runs = parse_runs(show)
    assert sorted(r.name for r in runs) == sorted(f"lr{lr}-seed-{s}" for lr in LRS for s in SEEDS)
    for r in runs:  # each experiment ran with its own seed and the overrides, in a temp dir of the queue
        lr, seed = float(r.name[2:6]), int(r.name[-1])
        assert (r.state, r.params, r.metric) == ("success", {"train.seed": seed, "train.optimizer.lr": lr, "train.steps": 3},
                                                  lr * 10 + seed * lr)

    groups = group_runs(runs, ["train.seed"])
    assert [g.params for g in groups] == [{"train.optimizer.lr": 0.02, "train.steps": 3}, {"train.optimizer.lr": 0.01, "train.steps": 3}]
    for g in groups:
        mean, low, high = _expected(g.params["train.optimizer.lr"])
        s = g.summary
        assert s.n == 3 and sorted(r.params["train.seed"] for r in g.runs) == list(SEEDS)
        assert (s.mean, s.low, s.high) == pytest.approx((mean, low, high), abs=1e-12)
        assert (s.min, s.max) == pytest.approx((g.params["train.optimizer.lr"] * 10, g.params["train.optimizer.lr"] * 12))

    assert experiments.main(["compare", "--root", str(repo)]) == 0
    printed = capfd.readouterr().out
    table = (repo / "outputs" / "seeds.md").read_text()
    assert table in printed
    rows = [line for line in table.splitlines() if line.startswith("| train.optimizer.lr=")]
    expected_rows = []
    for lr in (0.02, 0.01):
        mean, low, high = _expected(lr)
        expected_rows.append(f"| train.optimizer.lr={lr} | 3 | 0, 1, 2 | {mean:.4f} | [{low:.4f}, {high:.4f}] | "
                             f"{lr * 10:.4f} | {lr * 12:.4f} |")
    assert rows == expected_rows, table
    print(table)  # the figures, with -s

    # the options, on the same `dvc exp show --json`: another metric, more params ignored
    # (the learning rates pooled), a name prefix
    table = comparison(parse_runs(show, "metrics/final.json:n"), "metrics/final.json:n", ignore=["train.optimizer.*"],
                       prefix="lr0.02")
    assert "| (all the same) | 3 | 0, 1, 2 | 3.0000 | [3.0000, 3.0000] | 3.0000 | 3.0000 |" in table, table
    assert "`train.optimizer.*`" in table
    pooled = group_runs(runs, ["train.seed", "train.optimizer.*"])
    assert len(pooled) == 1 and pooled[0].summary.n == 6


def _show_entry(name, params, after, state="success"):
    data = {"params": {"params.yaml": {"data": params}},
            "metrics": {"metrics/headline.json": {"data": {"test_accuracy_before": 0.3, "test_accuracy_after": after,
                                                           "val_accuracy": after and after - 0.01}}}}
    return {"name": name, "executor": {"state": state}, "revs": [{"rev": name * 3, "data": data}]}


def test_the_narrow_table_lists_the_commit_and_finished_experiments_with_what_each_changed():
    """``python -m grpo.evaluation.experiments table`` on a hand-made ``dvc exp show --json``: the workspace
    and unfinished experiments are left out; the changed column names only the params that differ
    from the commit's, by their last key where it is unique."""
    from grpo.evaluation.experiments import narrow_table, table_rows

    base = {"train": {"order": "curriculum", "seed": 0, "loss": {"beta": 0.0}}, "sent": {"seed": 0}}
    show = [{"rev": "workspace", "data": {}, "experiments": []},
            {"rev": "abc1234", "name": "main", "data": _show_entry("main", base, 0.7)["revs"][0]["data"],
             "experiments": [
                 _show_entry("shuffled-seed-1", {"train": {**base["train"], "order": "shuffled", "seed": 1},
                                                 "sent": {"seed": 0}}, 0.52),
                 _show_entry("kl-seed-0", {"train": {**base["train"], "loss": {"beta": 0.04}}, "sent": {"seed": 0}}, 0.75),
                 _show_entry("g4-seed-0", base, None, state="queued")]}]
    lines = narrow_table(table_rows(show)).splitlines()
    assert lines[0].split() == ["experiment", "test", "before", "test", "after", "val", "changed"]
    assert [line.split()[0] for line in lines[1:]] == ["main", "shuffled-seed-1", "kl-seed-0"]
    assert lines[2].endswith("0.5200  0.5100  order=shuffled seed=1")
    assert lines[3].endswith("beta=0.04") and lines[1].rstrip().endswith("0.6900")
    assert max(len(line) for line in lines) < 80
    from grpo.evaluation.experiments import short_keys

    assert short_keys(["sent.seed", "train.seed", "train.loss.beta"]) == {
        "sent.seed": "sent.seed", "train.seed": "train.seed", "train.loss.beta": "beta"}
