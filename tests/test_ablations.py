"""Ablations (``grpo.evaluation.ablations``): the grid checked against the real params, the paired statistics
on hand-made numbers, and a tiny grid queued, run and compared through the real DVC queue."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo.algorithm.stats import holm
from grpo.evaluation import ablations
from grpo.evaluation.ablations import Grid, exp_name, load_grid, paired, plan, queue_args
from grpo.evaluation.experiments import Run, exp_show, parse_runs

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
    ({"train.loss.entropy_rule": "low", "train.loss.entropy_rule_options.low.top_quantile": 1.0},
     "train.loss.entropy_rule_options.low.top_quantile"),
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
    grid = Grid("default", (0, 1), {"default": {}, "kl": {"train.loss.beta": 0.04, "train.order": "shuffled"}})
    assert queue_args(grid, "kl", 1) == ["exp", "run", "--queue", "-S", "train.seed=1", "-S", "train.loss.beta=0.04",
                                         "-S", "train.order=shuffled", "-n", "kl-seed-1"]


def test_plan_queues_seed_by_seed_and_skips_finished_and_waiting():
    grid = Grid("default", (0, 1), {"default": {}, "g4": {"train.rollouts.group_size": 4}})
    runs = [Run("default-seed-0", "a", "success", {}, 0.7), Run("g4-seed-0", "b", "running", {}, None),
            Run("default-seed-1", "c", "failed", {}, None)]
    p = plan(grid, runs)
    assert p.done == ["default-seed-0"] and p.waiting == ["g4-seed-0"] and p.failed == ["default-seed-1"]
    assert p.queue == [("default", 1), ("g4", 1)]


def test_paired_difference_and_its_test_on_hand_made_numbers():
    ref = {0: 0.70, 1: 0.80, 2: 0.75}
    var = {0: 0.75, 1: 0.83, 2: 0.82}  # differences 0.05, 0.03, 0.07: mean 0.05, sd 0.02
    p = paired(ref, var)
    half = 4.302652729749 * 0.02 / math.sqrt(3)
    assert p.seeds == (0, 1, 2) and p.diffs == pytest.approx((0.05, 0.03, 0.07))
    assert (p.mean, p.test.low, p.test.high) == pytest.approx((0.05, 0.05 - half, 0.05 + half))
    # t = 0.05 / (0.02 / sqrt 3) = 4.330 on 2 df: two-sided p = 0.0494
    assert p.test.p == pytest.approx(0.04941, abs=1e-4)
    assert p.verdict == "no detectable difference"  # no Holm adjustment yet: no verdict
    assert paired(ref, {0: 0.6}).verdict == "too few seeds"  # one shared seed: no test
    assert paired(ref, {5: 0.6}).mean is None


def test_only_finished_experiments_count():
    """A queued or running experiment shows its baseline's metrics in `dvc exp show`: not a result."""
    grid = Grid("default", (0, 1), {"default": {}})
    runs = [Run("default-seed-0", "x", "success", {}, 0.7), Run("default-seed-1", "y", "queued", {}, 0.7)]
    assert ablations.values_by_variant(grid, runs) == {"default": {0: 0.7}}


def _runs(vals):
    return [Run(f"{v}-seed-{s}", "x", "success", {}, a) for v, per in vals.items() for s, a in per.items()]


def test_the_verdicts_are_holm_adjusted_over_both_metrics_and_every_variant():
    """Four comparisons (two variants x two metrics); the raw p-values are adjusted together, so a
    difference significant alone can lose its verdict in the family."""
    grid = Grid("ref", (0, 1, 2, 3, 4, 5), {"ref": {}, "a": {"train.rollouts.group_size": 4}, "b": {"train.optimizer.lr": 1e-3}})
    base = {s: 0.5 + 0.01 * s for s in range(6)}
    shift = lambda d, noise: {s: v + d + noise[s] for s, v in base.items()}  # noqa: E731
    noise = [0.01, -0.01, 0.005, -0.005, 0.0, 0.002]
    val = {"ref": base, "a": shift(0.05, noise), "b": shift(0.006, noise)}
    test = {"ref": base, "a": shift(0.04, noise), "b": shift(-0.004, noise)}
    table = ablations.rows(grid, {ablations.SELECT: _runs(val), ablations.TEST: _runs(test)})
    raw = {(r.variant, k): p.test.p for r in table for k, p in r.compared.items()}
    adjusted = holm({f"{v}|{k}": p for (v, k), p in raw.items()})
    for r in table:
        for k, p in r.compared.items():
            assert p.p_holm == pytest.approx(adjusted[f"{r.variant}|{k}"])
            assert p.p_holm >= p.test.p
    a = next(r for r in table if r.variant == "a")
    assert a.compared[ablations.SELECT].verdict == "better" and a.compared[ablations.TEST].verdict == "better"
    b = next(r for r in table if r.variant == "b")
    assert b.compared[ablations.SELECT].verdict == "no detectable difference"
    text = ablations.markdown(grid, table)
    assert "4 comparisons, Holm-adjusted" in text and "80% power" in text
    row = next(line for line in text.splitlines() if line.startswith("| a |"))
    assert f"{a.compared[ablations.SELECT].p_holm:.3f} | better |" in row


def test_the_decision_rule_picks_the_cheapest_candidate_within_the_margin():
    grid = Grid("ref", (0, 1), {"ref": {}, "cheap": {"train.optimizer.lr": 1e-3}, "dear": {"train.optimizer.lr": 2e-3}},
                decision={"candidates": ["cheap", "dear"], "margin": 0.02})
    val = {"ref": {0: 0.50, 1: 0.52}, "cheap": {0: 0.49, 1: 0.51}, "dear": {0: 0.51, 1: 0.53}}
    cost = {"ref": {0: 100.0, 1: 100.0}, "cheap": {0: 50.0, 1: 52.0}, "dear": {0: 90.0, 1: 90.0}}
    table = ablations.rows(grid, {ablations.SELECT: _runs(val), ablations.COST: _runs(cost)})
    assert "**cheap**, the cheapest candidate within 0.020 of the best variant (dear)" in ablations.decide(grid, table)[0]
    strict = Grid(grid.reference, grid.seeds, grid.variants, decision={"candidates": ["cheap"], "margin": 0.01})
    assert "no candidate is within 0.010 of the best (dear); the best candidate" in ablations.decide(strict, table)[0]
    three_seeds = Grid(grid.reference, (0, 1, 2), grid.variants, decision=grid.decision)  # seed 2 has not finished
    assert ablations.decide(three_seeds, table) == [
        "Decision: not yet: 4 of the candidates' 6 experiments have finished (waiting: cheap-seed-2, dear-seed-2)."]


STAGE = ("python -c \"import json, os, yaml; t = yaml.safe_load(open('params.yaml'))['train']; "
         "os.makedirs('metrics', exist_ok=True); "
         "acc = 0.5 + (0.1 if t['order'] == 'shuffled' else 0) + 0.01 * t['seed'] * (2 if t['order'] == 'shuffled' else 1); "
         "json.dump(dict(accuracy=acc), open('metrics/final.json', 'w')); "
         "json.dump(dict(final_val_accuracy=acc / 2, total_time_s=10.0), open('metrics/train.json', 'w'))\"")


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
    # shuffled - default: 0.1 + 0.01 s per seed -> 0.100, 0.110: mean 0.105 on both metrics
    test_part = table.split("Test accuracy")[1]
    row = next(line for line in test_part.splitlines() if line.startswith("| shuffled"))
    assert "| +0.105 |" in row and "| 0.600 / 0.620 |" in row  # the paired mean and the per-seed test accuracy
    assert (repo / "outputs" / "ablations" / "ablations.png").stat().st_size > 5000
    print(table)


PREP = ("python -c \"import os, yaml; d = yaml.safe_load(open('params.yaml'))['data']; "
        "os.makedirs('data', exist_ok=True); os.makedirs('metrics/time', exist_ok=True); "
        "open('data/prep.txt', 'w').write(str(d['seed'])); open('metrics/time/prep.json', 'w').write('{}'); "
        "open('{count}', 'a').write(str(d['seed']) + chr(10))\"")
TRAIN_ON_PREP = ("python -c \"import json, os, yaml; t = yaml.safe_load(open('params.yaml'))['train']; "
                 "os.makedirs('metrics', exist_ok=True); "
                 "acc = 0.5 + (0.1 if t['order'] == 'shuffled' else 0) + 0.01 * int(open('data/prep.txt').read()); "
                 "json.dump(dict(accuracy=acc), open('metrics/final.json', 'w')); "
                 "json.dump(dict(final_val_accuracy=acc, total_time_s=10.0), open('metrics/train.json', 'w'))\"")


GUARD = ("python -c \"import os; os.makedirs('metrics', exist_ok=True); "
         "open('metrics/ok.json', 'w').write('{}'); open('{count}.guard', 'a').write('x')\"")


@pytest.mark.slow
@pytest.mark.parametrize("guarded", [False, True])
def test_each_seeds_shared_stage_runs_once_not_once_per_experiment(tmp_path, monkeypatch, capfd, guarded):
    """A data stage no variant sets a param of runs once per seed (two, not four runs for two
    variants), each experiment trains on its own seed's data, and params.yaml and dvc.lock are
    as committed afterwards; also behind a guard that reads every param and that both stages depend
    on (``meta: {guard: true}``, as check_params): it runs in every experiment and holds nothing back."""
    monkeypatch.setenv("DVC_NO_ANALYTICS", "1")
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    repo, count = tmp_path / "repo", tmp_path / "prep_runs.txt"
    repo.mkdir()
    grid = _grid_file(repo, {"default": {}, "shuffled": {"train.order": "shuffled"}}, seeds=[0, 3])
    grid.write_text(yaml.safe_dump({**yaml.safe_load(grid.read_text()), "seed_keys": ["data.seed", "train.seed"]}))
    stages = {"prep": {"cmd": PREP.replace("{count}", str(count)), "params": ["data"], "outs": ["data/prep.txt"],
                       "metrics": [{"metrics/time/prep.json": {"cache": False}}]},
              "train": {"cmd": TRAIN_ON_PREP, "deps": ["data/prep.txt"], "params": ["train"],
                        "metrics": [{"metrics/final.json": {"cache": False}}, {"metrics/train.json": {"cache": False}}]}}
    if guarded:
        guard = {"cmd": GUARD.replace("{count}", str(count)), "meta": {"guard": True}, "params": [{"params.yaml": None}],
                 "outs": [{"metrics/ok.json": {"cache": False, "persist": True}}]}
        stages = {"check": guard, **{name: {**st, "deps": ["metrics/ok.json", *st.get("deps", [])]}
                                     for name, st in stages.items()}}
    (repo / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    git_dvc_init(repo)
    committed = (repo / "params.yaml").read_text()
    assert ablations.main(["run", "--root", str(repo)]) == 0
    out = capfd.readouterr().out
    assert "prep run once per seed in the workspace" in out
    assert count.read_text().split() == ["0", "3"]  # once per seed, in seed order
    if guarded:  # once per seed's shared stages, then in each of the four experiments
        assert len(Path(f"{count}.guard").read_text()) >= 4
    runs = {r.name: r.metric for r in parse_runs(exp_show(repo), ablations.TEST)}
    assert runs == pytest.approx({"default-seed-0": 0.5, "shuffled-seed-0": 0.6, "default-seed-3": 0.53,
                                  "shuffled-seed-3": 0.63})
    assert (repo / "params.yaml").read_text() == committed
    status = subprocess.run(["git", "status", "--porcelain", "params.yaml", "dvc.lock"], cwd=repo, capture_output=True,
                            text=True)
    assert status.stdout == ""


def test_stale_tasks_are_the_running_ones_without_a_worker():
    status = ("Task     Name             Created    Status\n"
              "a636950  shuffled-seed-0  01:37 AM   Running\n"
              "0822211  reversed-seed-0  01:37 AM   Queued\n\n")
    assert ablations.stale_tasks(status + "Worker status: 0 active, 0 idle") == ["a636950"]
    assert ablations.stale_tasks(status + "Worker status: 1 active, 0 idle") == []


def test_the_reasoning_grid_is_valid_and_declares_its_decision_rule():
    grid = load_grid(ROOT / "experiments" / "reasoning_grid.yaml")
    assert grid.reference == "every-token" and len(grid.seeds) >= 6
    assert {"top-0.2", "top-0.5", "sent_kl", "archer-mu2"} <= set(grid.variants)
    assert set(grid.decision["candidates"]) == {"top-0.2", "top-0.5", "sent_kl", "archer-mu2"}
    # a rule's variant names its rule: its meaning does not move when params.yaml's default does
    assert all(grid.variants[v].get("train.loss.entropy_rule") for v in grid.decision["candidates"])
    assert grid.variants["archer-mu2"]["train.optimizer.mu"] == 2


def test_a_second_reference_is_refused_with_one_line(tmp_path):
    path = _grid_file(tmp_path, {"default": {}, "all": {}}, reference="all")
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "second_reference": "default"}))
    with pytest.raises(ValueError, match="second_reference was dropped"):
        load_grid(path)


def test_a_record_carries_finished_experiments_to_another_clone(tmp_path):
    """compare's record holds every finished experiment of the grid; another clone's plan counts them
    as done (a failed run of the same name there does not undo it); another CPU kind is refused."""
    grid = Grid("default", (0, 1), {"default": {}, "g4": {"train.rollouts.group_size": 4}})
    runs = {key: [Run("default-seed-0", "a", "success", {}, 0.7), Run("g4-seed-0", "b", "queued", {}, 0.7),
                  Run("other-seed-0", "c", "success", {}, 0.1)] for key in ablations.METRICS}
    path = tmp_path / "record.json"
    ablations.write_record(path, grid, runs)
    recorded = ablations.record_runs(path)
    assert [r.name for r in recorded[ablations.TEST]] == ["default-seed-0"]  # not the queued, not another grid's
    p = plan(grid, recorded[ablations.TEST] + [Run("default-seed-0", "x", "failed", {}, None)])
    assert p.done == ["default-seed-0"] and ("default", 0) not in p.queue and ("g4", 0) in p.queue
    raw = json.loads(path.read_text())
    path.write_text(json.dumps({**raw, "cpu": "another CPU"}))
    with pytest.raises(ValueError, match="recorded on 'another CPU'"):
        ablations.record_runs(path)


def test_a_metric_dvc_exp_show_does_not_list_is_read_from_the_experiments_commit(tmp_path):
    """metrics/train.json is a stage output, not a declared metric: its keys come from the commit."""
    import subprocess

    (tmp_path / "metrics").mkdir()
    (tmp_path / "metrics" / "train.json").write_text(json.dumps({"final_val_accuracy": 0.42, "total_time_s": 150.5}))
    for cmd in (["git", "init", "-q"], ["git", "add", "-A"],
                ["git", "-c", "user.email=a@b", "-c", "user.name=a", "commit", "-qm", "exp"]):
        subprocess.run(cmd, cwd=tmp_path, check=True)
    rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=tmp_path, capture_output=True, text=True).stdout.strip()
    run = Run("every-token-seed-0", rev, "success", {}, None)
    assert ablations.from_commit(tmp_path, run, ablations.SELECT).metric == 0.42
    assert ablations.from_commit(tmp_path, run, ablations.COST).metric == 150.5
    assert ablations.from_commit(tmp_path, run, ablations.CLIP).metric is None  # not in the file
    queued = Run("x", rev, "queued", {}, None)
    assert ablations.from_commit(tmp_path, queued, ablations.SELECT).metric is None  # not finished: not read


def test_a_variant_paired_with_another_joins_the_same_holm_family():
    """``shuffled`` is compared to ``rule`` (its own pair), the others to the reference; three
    comparisons per metric, adjusted together."""
    grid = Grid("ref", (0, 1, 2), {"ref": {}, "rule": {"train.optimizer.lr": 1e-3}, "shuffled": {"train.order": "shuffled"}},
                paired_with={"shuffled": "rule"})
    val = {"ref": {0: 0.50, 1: 0.52, 2: 0.51}, "rule": {0: 0.60, 1: 0.61, 2: 0.63},
           "shuffled": {0: 0.40, 1: 0.42, 2: 0.40}}
    table = ablations.rows(grid, {ablations.SELECT: _runs(val)})
    shuffled = next(r for r in table if r.variant == "shuffled").compared[ablations.SELECT]
    assert shuffled.diffs == pytest.approx((-0.20, -0.19, -0.23))  # against rule, not ref
    raw = {f"{r.variant}": p.test.p for r in table for p in r.compared.values()}
    assert shuffled.p_holm == pytest.approx(holm(raw)["shuffled"])
    assert "-0.207 (vs rule)" in ablations.markdown(grid, table)


def test_paired_with_names_variants_of_the_grid(tmp_path):
    path = _grid_file(tmp_path, {"default": {}, "a": {}})
    raw = yaml.safe_load(path.read_text())
    for pairs in ({"a": "nope"}, {"default": "a"}, {"a": "a"}):
        path.write_text(yaml.safe_dump({**raw, "paired_with": pairs}))
        with pytest.raises(ValueError, match="paired_with"):
            load_grid(path)


def test_the_rule_mu_grid_runs_each_rule_at_both_mus_on_seed_triples_with_every_token_a_candidate():
    """Issue 58's controls: every variant names its mu, rule and checkpoint choice; every-token and
    archer each at mu 1 and mu 2; at least eight seeds, each setting the data, SENT and training seeds."""
    grid = load_grid(ROOT / "experiments" / "rule_mu_grid.yaml")
    pairs = {(o["train.loss.entropy_rule"], o[f"train.loss.entropy_rule_options.{o['train.loss.entropy_rule']}.top_quantile"],
              o["train.optimizer.mu"]) for o in grid.variants.values()}
    assert pairs == {("high", 1.0, 1), ("high", 1.0, 2), ("archer", 0.2, 1), ("archer", 0.2, 2)}
    assert all(o["train.checkpoints.keep_best"] is False for o in grid.variants.values())  # last step only: no checkpoint chosen
    assert len(grid.seeds) >= 8 and set(grid.seed_keys) == {"data.seed", "sent.seed", "train.seed"}
    assert set(grid.decision["candidates"]) == set(grid.variants)
    # rules are compared at equal mu: archer-mu2 with every-token-mu2, archer-mu1 with the mu-1 reference
    assert grid.variants[grid.partner("archer-mu2")]["train.optimizer.mu"] == 2
    assert grid.variants[grid.partner("archer-mu1")]["train.optimizer.mu"] == 1
    args = queue_args(grid, "archer-mu1", 5)
    assert all(f"{key}=5" in args for key in grid.seed_keys)


def test_the_reasoning_grid_names_each_variants_mu_as_run():
    grid = load_grid(ROOT / "experiments" / "reasoning_grid.yaml")
    assert grid.seed_keys == ("train.seed",)  # as run: data and SENT seeds fixed
    assert {v: o["train.optimizer.mu"] for v, o in grid.variants.items()} == {
        "every-token": 1, "top-0.2": 1, "top-0.5": 1, "sent_kl": 1, "archer-mu2": 2, "shuffled-archer-mu2": 2}


def test_a_pinned_key_a_variant_leaves_to_the_default_fails_naming_both(tmp_path):
    path = _grid_file(tmp_path, {"default": {"train.optimizer.mu": 1}, "loose": {"train.optimizer.lr": 1e-3}})
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "pinned": ["train.optimizer.mu"]}))
    with pytest.raises(ValueError, match="'loose': does not set train.optimizer.mu"):
        load_grid(path)


@pytest.mark.parametrize(("seed_keys", "variants", "words"), [
    (["data.seed", "train.seed"], {"default": {}, "bad": {"data.seed": 3}}, "'bad': data.seed is set per experiment"),
    (["data.sead"], {"default": {}}, "data.sead"),
])
def test_seed_keys_are_params_keys_no_variant_sets(tmp_path, seed_keys, variants, words):
    path = _grid_file(tmp_path, variants)
    raw = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**raw, "seed_keys": seed_keys}))
    with pytest.raises(ValueError, match=words):
        load_grid(path)


def test_queue_args_set_every_seed_key_to_the_experiments_seed():
    grid = Grid("a", (0, 3), {"a": {"train.optimizer.mu": 2}}, seed_keys=("data.seed", "sent.seed", "train.seed"))
    assert queue_args(grid, "a", 3) == ["exp", "run", "--queue", "-S", "data.seed=3", "-S", "sent.seed=3",
                                        "-S", "train.seed=3", "-S", "train.optimizer.mu=2", "-n", "a-seed-3"]


def test_the_decision_at_equal_mu_picks_every_token_when_the_entropy_treatment_does_not_pay():
    """archer-mu2 is the best on validation, every-token-mu2 0.01 behind and cheaper: the rule
    picks every-token-mu2; every-token-mu1 (cheapest) is 0.05 behind, beyond the margin."""
    names = ("et1", "et2", "ar1", "ar2")
    grid = Grid("et1", (0, 1, 2), {n: {"train.optimizer.mu": 1 + n.endswith("2")} for n in names},
                decision={"candidates": list(names), "margin": 0.03}, paired_with={"ar2": "et2"})
    best = {0: 0.60, 1: 0.55, 2: 0.58}
    behind = {"et1": (0.05, 0.04, 0.06), "et2": (0.01, 0.0, 0.02), "ar1": (0.05, 0.05, 0.05), "ar2": (0, 0, 0)}
    val = {n: {s: best[s] - d[s] for s in best} for n, d in behind.items()}
    cost = {"et1": 150.0, "et2": 250.0, "ar1": 180.0, "ar2": 290.0}
    table = ablations.rows(grid, {ablations.SELECT: _runs(val),
                                  ablations.COST: _runs({n: dict.fromkeys(best, c) for n, c in cost.items()})})
    line = ablations.decide(grid, table)[0]
    assert "**et2**, the cheapest candidate within 0.030 of the best variant (ar2)" in line
    assert f"train stage {cost['et2']:.0f} s" in line
    shortfalls = [behind[n] for n in ("et1", "et2", "ar1")]
    sd = ablations.pooled_sd(shortfalls)
    assert f"sd {sd:.3f} over 3 seeds" in line and f"{ablations.detectable(sd, 3):.3f}" in line
    ar2 = next(r for r in table if r.variant == "ar2").compared[ablations.SELECT]
    assert ar2.diffs == pytest.approx(behind["et2"])  # ar2 - et2, seed by seed: paired at equal mu


def test_the_headline_is_the_seed_mean_before_and_after_with_one_interval_method():
    """Before comes from whichever variant ran the seed (the baseline does not depend on it); both
    sides are means over the same seeds with the t interval across seeds."""
    from scipy import stats

    grid = Grid("a", (0, 1, 2), {"a": {}, "b": {"train.optimizer.mu": 2}},
                decision={"candidates": ["a", "b"], "margin": 0.5})
    after = {"a": {0: 0.50, 1: 0.40, 2: 0.45}, "b": {0: 0.52, 1: 0.41, 2: 0.47}}
    before = {"a": {0: 0.09, 1: 0.11}, "b": {0: 0.09, 2: 0.07}}  # seed 2's baseline only in b's run
    table = ablations.rows(grid, {ablations.TEST: _runs(after), ablations.SELECT: _runs(after),
                                  ablations.BEFORE: _runs(before), ablations.COST: _runs({"a": {0: 1.0, 1: 1.0, 2: 1.0},
                                                                                          "b": {0: 2.0, 1: 2.0, 2: 2.0}}),
                                  ablations.N_EFF_AFTER: _runs({"a": {0: 300.0, 1: 200.0, 2: 250.0}})})
    h = ablations.headline(table, "a")
    assert h.seeds == (0, 1, 2)
    for side, values in ((h.before, [0.09, 0.11, 0.07]), (h.after, [0.50, 0.40, 0.45])):
        half = stats.t.ppf(0.975, 2) * stats.tstd(values) / math.sqrt(3)
        assert side.mean == pytest.approx(sum(values) / 3)
        assert (side.low, side.high) == pytest.approx((side.mean - half, side.mean + half))
    assert h.n_eff_after == pytest.approx(250.0) and h.n_eff_before is None
    text = ablations.markdown(grid, table)
    assert "Decision (rule committed before the grid ran): **a**" in text  # the cheaper, within the margin
    row = next(line for line in text.splitlines() if line.startswith("| **a** | 3 |"))
    assert f"{h.before.mean:.3f} [{h.before.low:.3f}, {h.before.high:.3f}]" in row
    assert f"{h.after.mean:.3f} [{h.after.low:.3f}, {h.after.high:.3f}]" in row


def test_a_baseline_that_differs_between_two_variants_of_one_seed_is_refused():
    grid = Grid("a", (0, 1), {"a": {}, "b": {"train.optimizer.mu": 2}})
    table = ablations.rows(grid, {ablations.TEST: _runs({"a": {0: 0.5, 1: 0.4}}),
                                  ablations.BEFORE: _runs({"a": {0: 0.09, 1: 0.1}, "b": {0: 0.08}})})
    with pytest.raises(ValueError, match="seed 0: metrics/baseline.json:accuracy is 0.09 .* 0.08 in b's"):
        ablations.headline(table, "a")


def test_where_the_rule_acted_is_shown_seed_by_seed():
    grid = Grid("et", (0, 1), {"et": {}, "ar": {"train.optimizer.mu": 2}})
    band = {"ar": {0: 0.0116, 1: 0.0093}}
    table = ablations.rows(grid, {ablations.SELECT: _runs({"et": {0: 0.3, 1: 0.3}, "ar": {0: 0.3, 1: 0.4}}),
                                  ablations.BAND: _runs(band)})
    text = ablations.markdown(grid, table)
    assert "| ar | wide-clip tokens in the band | 0.0116 / 0.0093 |" in text
    assert "| et | wide-clip" not in text



def test_the_noninferiority_rule_picks_the_cheapest_candidate_shown_not_worse_than_the_incumbent():
    """The incumbent stays unless a cheaper candidate is shown not worse by the margin (one-sided,
    Holm over the candidates); the design's own 80%-power margin is stated, and a committed margin
    below it is said to leave a non-inferior candidate likely unproven."""
    variants = {"inc": {}, "close": {"train.optimizer.lr": 1e-3}, "far": {"train.optimizer.lr": 2e-3}}
    seeds = tuple(range(6))
    val = {"inc": {s: 0.50 + 0.01 * s for s in seeds},
           "close": {s: 0.50 + 0.01 * s + (0.01 if s % 2 else -0.01) for s in seeds},
           "far": {s: 0.30 + 0.01 * s + (0.02 if s % 2 else -0.02) for s in seeds}}
    cost = {"inc": {s: 100.0 for s in seeds}, "close": {s: 60.0 for s in seeds}, "far": {s: 40.0 for s in seeds}}
    runs = {ablations.SELECT: _runs(val), ablations.COST: _runs(cost)}

    def decided(margin):
        grid = Grid("inc", seeds, variants, decision={"rule": "noninferior", "incumbent": "inc",
                                                      "candidates": ["close", "far"], "margin": margin})
        return ablations.choose(grid, ablations.rows(grid, runs))

    pick, lines = decided(0.05)  # far is 0.2 behind: not shown within 0.05; close is: the cheapest proven
    assert pick == "close" and "**close**, the cheapest candidate not worse than inc by 0.050" in lines[0]
    assert "far (+0.200, p 1.000" in lines[0] and "establishes a margin of" in lines[0]
    pick, lines = decided(0.30)  # both within 0.30: far is cheaper
    assert pick == "far"
    pick, lines = decided(0.001)  # nothing is shown within 0.001: the incumbent stays, and the margin is too small
    assert pick == "inc" and "the incumbent stays" in lines[0] and "likely left unproven" in lines[0]


def test_a_noninferiority_rule_names_an_incumbent_outside_its_candidates(tmp_path):
    path = _grid_file(tmp_path, {"default": {}, "b": {"train.order": "shuffled"}})
    raw = yaml.safe_load(path.read_text())
    raw["decision"] = {"rule": "noninferior", "incumbent": "b", "candidates": ["b"], "margin": 0.1}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match="'rule: noninferior' with an 'incumbent'"):
        load_grid(path)


def test_the_cost_grids_margin_is_what_its_design_establishes_with_80_percent_power():
    """experiments/cost_grid.yaml's non-inferiority margin is at least the margin its 8 seeds establish
    with 80% power at Holm's strictest level, at the spread of the mu grid's paired differences to the
    incumbent (the record of the runs before it): a smaller one would leave a candidate as good as the
    incumbent unproven more often than not."""
    from grpo.algorithm.stats import noninferiority_margin, pooled_sd

    grid = load_grid(ROOT / "experiments" / "cost_grid.yaml")
    d = grid.decision
    assert d["rule"] == "noninferior" and d["incumbent"] == grid.reference == "archer-mu2"
    assert {grid.variants[c]["train.optimizer.equal_reward_groups"] for c in d["candidates"]} == {"drop"}
    record = json.loads((ROOT / "experiments" / "results" / "rule_mu_grid.json").read_text())
    val = record["values"][ablations.SELECT]
    diffs = [tuple(val[f"archer-mu2-seed-{s}"] - val[f"{c}-seed-{s}"] for s in grid.seeds)
             for c in ("every-token-mu1", "every-token-mu2", "archer-mu1")]
    need = noninferiority_margin(pooled_sd(diffs), len(grid.seeds), ablations.ALPHA / len(d["candidates"]))
    assert need <= d["margin"] < need + 0.01


def test_a_confirmation_grid_of_one_variant_writes_its_headline_as_the_chosen_one(tmp_path):
    """A grid of one variant and no decision (the chosen default on fresh seeds): its table, plot and
    headline file are written, the headline's pick is that variant (the pages read it), and a grid of
    two variants without a decision picks none."""
    from grpo.evaluation import seed_headline

    grid = Grid("chosen", (8, 9, 10), {"chosen": {"train.optimizer.mu": 1}}, confirms="experiments/grid.yaml")
    after, before = {"chosen": {8: 0.50, 9: 0.40, 10: 0.45}}, {"chosen": {8: 0.09, 9: 0.11, 10: 0.07}}
    table = ablations.rows(grid, {ablations.TEST: _runs(after), ablations.SELECT: _runs(after),
                                  ablations.BEFORE: _runs(before)})
    assert "| **chosen** | 3 |" in ablations.markdown(grid, table)
    ablations.forest_plot(grid, table, tmp_path / "plot.png")
    path = tmp_path / "headline.json"
    ablations.write_headlines(path, "experiments/confirm.yaml", grid, table)
    head = seed_headline.read(path)
    assert head["chosen"] == "chosen" and head["confirms"] == "experiments/grid.yaml"
    assert head["variants"]["chosen"]["seeds"] == [8, 9, 10]
    assert head["variants"]["chosen"]["after"]["mean"] == pytest.approx(0.45)
    plain = Grid("chosen", (8, 9, 10), {"chosen": {"train.optimizer.mu": 1}})  # one variant, confirming nothing
    assert ablations.headline_pick(plain, table) is None


@pytest.mark.parametrize(("extra", "words"), [
    ({"confirms": "experiments/missing.yaml"}, "not a file of the repository"),
    ({"confirms": "params.yaml", "variants": {"a": {}, "b": {"train.seed": 1}}}, "a grid of one variant"),
    ({"confirms": 3}, "a string"),
])
def test_confirms_names_a_file_in_a_grid_of_one_variant(tmp_path, extra, words):
    path = _grid_file(tmp_path, {"a": {}}, reference="a")
    raw = {**yaml.safe_load(path.read_text()), **extra}
    path.write_text(yaml.safe_dump(raw))
    with pytest.raises(ValueError, match=words):
        load_grid(path)
    raw["confirms"] = "params.yaml"
    raw["variants"] = {"a": {}}
    path.write_text(yaml.safe_dump(raw))
    assert load_grid(path).confirms == "params.yaml"
