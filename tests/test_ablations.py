"""Ablations (``grpo.ablations``): the grid checked against the real params, the paired statistics
on hand-made numbers, and a tiny grid queued, run and compared through the real DVC queue."""

from __future__ import annotations

import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import yaml

from grpo import ablations
from grpo.ablations import Grid, exp_name, load_grid, paired, plan, queue_args
from grpo.experiments import Run, exp_show, parse_runs

from .helpers import git_dvc_init

ROOT = Path(__file__).resolve().parent.parent


def _grid_file(tmp_path: Path, variants: dict, seeds=(0, 1, 2), reference="default") -> Path:
    path = tmp_path / "experiments" / "ablations.yaml"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump({"reference": reference, "seeds": list(seeds), "variants": variants}))
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    return path


def test_the_committed_grid_is_valid_and_has_the_reference():
    grid = load_grid(ROOT / ablations.GRID)
    assert grid.variants[grid.reference] == {}
    assert len(grid.variants) >= 8 and grid.seeds == (0, 1, 2)


@pytest.mark.parametrize(("overrides", "words"), [
    ({"train.ordr": "shuffled"}, "train.ordr"),
    ({"train.order": "backwards"}, "train.order"),
    ({"train.entropy_rule": "low", "train.entropy_top_quantile": 1.0}, "train.entropy_rule"),
    ({"train.seed": 3}, "train.seed"),
])
def test_a_bad_variant_fails_naming_the_variant_and_the_key(tmp_path, overrides, words):
    path = _grid_file(tmp_path, {"default": {}, "bad": overrides})
    with pytest.raises(ValueError) as err:
        load_grid(path)
    assert "'bad'" in str(err.value) and words in str(err.value)


def test_reference_must_be_a_variant(tmp_path):
    with pytest.raises(ValueError, match="reference"):
        load_grid(_grid_file(tmp_path, {"a": {}}, reference="default"))


def test_queue_args_name_the_variant_and_seed():
    grid = Grid("default", (0, 1), {"default": {}, "kl": {"train.beta": 0.04, "train.order": "shuffled"}})
    assert queue_args(grid, "kl", 1) == ["exp", "run", "--queue", "-S", "train.seed=1", "-S", "train.beta=0.04",
                                         "-S", "train.order=shuffled", "-n", "kl-seed-1"]


def test_plan_queues_seed_by_seed_and_skips_finished_and_waiting():
    grid = Grid("default", (0, 1), {"default": {}, "g4": {"train.group_size": 4}})
    runs = [Run("default-seed-0", "a", "success", {}, 0.7), Run("g4-seed-0", "b", "running", {}, None),
            Run("default-seed-1", "c", "failed", {}, None)]
    p = plan(grid, runs)
    assert p.done == ["default-seed-0"] and p.waiting == ["g4-seed-0"] and p.failed == ["default-seed-1"]
    assert p.queue == [("default", 1), ("g4", 1)]


def test_paired_difference_and_interval_on_hand_made_numbers():
    ref = {0: 0.70, 1: 0.80, 2: 0.75}
    var = {0: 0.75, 1: 0.83, 2: 0.82}  # differences 0.05, 0.03, 0.07: mean 0.05, sd 0.02
    p = paired(ref, var)
    half = 4.302652729749 * 0.02 / math.sqrt(3)
    assert p.seeds == (0, 1, 2) and p.diffs == pytest.approx((0.05, 0.03, 0.07))
    assert (p.mean, p.low, p.high) == pytest.approx((0.05, 0.05 - half, 0.05 + half))
    assert p.verdict == "better"
    spans = paired(ref, {0: 0.72, 1: 0.78, 2: 0.76})  # +0.02, -0.02, +0.01
    assert spans.low < 0 < spans.high and spans.verdict == "no detectable difference"
    assert paired(ref, {0: 0.6}).verdict == "too few seeds"  # one shared seed: no interval
    assert paired(ref, {5: 0.6}).mean is None
    assert ablations.detectable(0.02, 3) == pytest.approx(half)


def test_only_finished_experiments_count():
    """A queued or running experiment shows its baseline's metrics in `dvc exp show`: not a result."""
    grid = Grid("default", (0, 1), {"default": {}})
    runs = [Run("default-seed-0", "x", "success", {}, 0.7), Run("default-seed-1", "y", "queued", {}, 0.7)]
    assert ablations.values_by_variant(grid, runs) == {"default": {0: 0.7}}


def test_the_table_has_a_test_and_a_validation_part_each_with_its_seeds():
    grid = Grid("default", (0, 1, 2), {"default": {}, "g4": {"train.group_size": 4}})
    runs = lambda vals: [Run(f"{v}-seed-{s}", "x", "success", {}, a) for v, per in vals.items()  # noqa: E731
                         for s, a in per.items()]
    test = {"default": {0: 0.70, 1: 0.80, 2: 0.75}, "g4": {0: 0.75, 1: 0.83, 2: 0.82}}
    val = {"default": {0: 0.60, 1: 0.61, 2: 0.62}, "g4": {0: 0.50, 1: 0.52, 2: 0.51}}
    text = ablations.markdown(grid, ablations.rows(grid, runs(test), runs(val)))
    test_part, val_part = text.split("Validation accuracy")
    # what a reader needs first: the verdict, the paired difference, the mean; then seeds and changes
    assert "| g4 | better | +0.050 [" in test_part
    assert "| 0.800 | 0.750 / 0.830 / 0.820 | `group_size=4` |" in test_part
    assert "| g4 | worse | -0.100 [" in val_part and "| 0.510 | 0.500 / 0.520 / 0.510 | `group_size=4` |" in val_part
    assert "| **default** | reference |  | 0.610 | 0.600 / 0.610 / 0.620 | params.yaml |" in val_part


STAGE = ("python -c \"import json, os, yaml; t = yaml.safe_load(open('params.yaml'))['train']; "
         "os.makedirs('metrics', exist_ok=True); "
         "acc = 0.5 + (0.1 if t['order'] == 'shuffled' else 0) + 0.01 * t['seed'] * (2 if t['order'] == 'shuffled' else 1); "
         "json.dump(dict(accuracy=acc), open('metrics/final.json', 'w')); "
         "json.dump(dict(best_val_accuracy=acc / 2), open('metrics/train.json', 'w'))\"")


def _tiny_repo(path: Path, seeds) -> Path:
    path.mkdir()
    _grid_file(path, {"default": {}, "shuffled": {"train.order": "shuffled"}}, seeds=seeds)
    stages = {"train": {"cmd": STAGE, "params": ["train"],
                        "metrics": [{"metrics/final.json": {"cache": False}}, {"metrics/train.json": {"cache": False}}]}}
    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    return git_dvc_init(path)


@pytest.mark.slow
def test_a_grid_runs_through_the_dvc_queue_resumes_and_compares_in_pairs(tmp_path, monkeypatch, capfd):
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    repo = _tiny_repo(tmp_path / "repo", seeds=[0])
    assert ablations.main(["run", "--root", str(repo)]) == 0
    assert "0 finished, 0 waiting in the queue, 2 to queue" in capfd.readouterr().out

    # a longer grid (a queue that had stopped after seed 0): only seed 1 runs
    _grid_file(repo, {"default": {}, "shuffled": {"train.order": "shuffled"}}, seeds=[0, 1])
    assert ablations.main(["run", "--root", str(repo)]) == 0
    assert "2 finished, 0 waiting in the queue, 2 to queue" in capfd.readouterr().out
    assert ablations.main(["run", "--root", str(repo)]) == 0  # nothing left: runs nothing, compares
    out = capfd.readouterr().out
    assert "4 finished, 0 waiting in the queue, 0 to queue" in out and "| shuffled" in out
    (repo / "outputs" / "ablations" / "ablations.md").unlink()  # compare alone writes it again

    runs = parse_runs(exp_show(repo))
    assert sorted(r.name for r in runs) == sorted(exp_name(v, s) for v in ("default", "shuffled") for s in (0, 1))
    assert ablations.main(["compare", "--root", str(repo)]) == 0
    table = (repo / "outputs" / "ablations" / "ablations.md").read_text()
    # shuffled - default: 0.1 + 0.01 s per seed -> 0.100, 0.110: mean 0.105, t(0.975, 1) x 0.00707 / sqrt(2)
    half = 12.70620473617 * (0.01 / math.sqrt(2)) / math.sqrt(2)
    row = next(line for line in table.splitlines() if line.startswith("| shuffled"))
    assert f"+0.105 [{0.105 - half:+.3f}, {0.105 + half:+.3f}]" in row and "better" in row
    assert "| 0.610 | 0.600 / 0.620 |" in row  # the mean and the per-seed test accuracy
    assert (repo / "outputs" / "ablations" / "ablations.png").stat().st_size > 5000
    print(table)


def test_stale_tasks_are_the_running_ones_without_a_worker():
    status = ("Task     Name             Created    Status\n"
              "a636950  shuffled-seed-0  01:37 AM   Running\n"
              "0822211  reversed-seed-0  01:37 AM   Queued\n\n")
    assert ablations.stale_tasks(status + "Worker status: 0 active, 0 idle") == ["a636950"]
    assert ablations.stale_tasks(status + "Worker status: 1 active, 0 idle") == []


def test_the_token_rules_grid_is_valid_with_two_references():
    grid = load_grid(ROOT / "experiments" / "token_rules.yaml")
    assert grid.reference == "every-token" and grid.second_reference == "default" and grid.seeds == (0, 1, 2, 3, 4)
    assert grid.variants["every-token"] == {"train.entropy_top_quantile": 1.0} and grid.variants["default"] == {}
    assert {"archer", "top-0.2", "top-0.5", "top-0.8", "shuffled"} <= set(grid.variants)
    # a rule's variant names its rule: its meaning does not move when params.yaml's default does
    assert all(grid.variants[v].get("train.entropy_rule") for v in ("archer", "top-0.2", "top-0.5", "top-0.8"))


def test_a_second_reference_gets_its_own_column_of_paired_differences(tmp_path):
    """Reference ``all``, second reference ``default``: each row also shows its paired difference to
    ``default`` with the verdict (``g4`` - ``default`` = +0.05, +0.03, +0.07: better; ``all`` -
    ``default`` = -0.1 every seed: worse, an interval of width 0), empty on ``default``'s own row; a
    second reference that is not a variant, or is the reference, fails."""
    grid = Grid("all", (0, 1, 2), {"default": {}, "all": {"train.entropy_top_quantile": 1.0},
                                    "g4": {"train.group_size": 4}}, second_reference="default")
    runs = lambda vals: [Run(f"{v}-seed-{s}", "x", "success", {}, a) for v, per in vals.items()  # noqa: E731
                         for s, a in per.items()]
    test = {"default": {0: 0.70, 1: 0.80, 2: 0.75}, "all": {0: 0.60, 1: 0.70, 2: 0.65},
            "g4": {0: 0.75, 1: 0.83, 2: 0.82}}
    text = ablations.markdown(grid, ablations.rows(grid, runs(test), runs(test)))
    test_part = text.split("Validation accuracy")[0]
    assert "| variant | verdict | minus all [95%] | minus default [95%] | mean |" in test_part
    assert "| default | better | +0.100 [+0.100, +0.100] |  | 0.750 |" in test_part
    assert "| **all** | reference |  | -0.100 [-0.100, -0.100]: worse | 0.650 |" in test_part
    # g4 - default: mean 0.05, sd 0.02, half-width t(0.975, 2) 0.02 / sqrt(3) = 0.0497: [+0.0003, +0.0997]
    assert "| g4 | better | +0.150 [+0.100, +0.200] | +0.050 [+0.000, +0.100]: better | 0.800 |" in test_part
    for second in ("nope", "all"):
        path = _grid_file(tmp_path, {"default": {}, "all": {}}, reference="all")
        raw = yaml.safe_load(path.read_text())
        path.write_text(yaml.safe_dump({**raw, "second_reference": second}))
        with pytest.raises(ValueError, match="second_reference"):
            load_grid(path)
