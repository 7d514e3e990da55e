"""`dvc exp show` of this repo's dvc.yaml stays readable: a tiny DVC repo with the real dvc.yaml and
params.yaml, each stage's command replaced by a script that writes the stage's declared outputs (the
committed metrics files where the repo has them), runs the pipeline and two experiments; the table of
the documented command (docs/orchestration.md) then has the headline accuracies and the params that
differ, and fits 200 columns."""

from __future__ import annotations

import csv
import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from .helpers import fake_stage_repo

pytestmark = pytest.mark.slow

# the command docs/orchestration.md, the README and dvc.yaml's header give
TABLE = ["exp", "show", "--only-changed", "--drop", ".*/|[a-z_]+$", "--keep", "test_accuracy.*|metrics/headline.json:.*"]
HEADLINE = ["test_accuracy_before", "test_accuracy_after", "val_accuracy"]
HEADLINE_COLUMNS = ["test_accuracy_before", "test_accuracy_after", "metrics/headline.json:val_accuracy"]


def _dvc(repo: Path, *args: str, columns: int = 200) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "COLUMNS": str(columns),
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    proc = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, capture_output=True, text=True, env=env,
                          timeout=600)
    assert proc.returncode == 0, f"dvc {args}: {proc.stdout[-2000:]}\n{proc.stderr[-2000:]}"
    return proc.stdout


@pytest.fixture(scope="module")
def repo(tmp_path_factory) -> Path:
    """The real dvc.yaml (stage commands faked), params.yaml and the code files the stages depend on,
    after `dvc repro` and two experiments (train.seed=1; train.optimizer.lr=0.0005). A plain `dvc exp show`
    of it still has ~160 columns (every param of params.yaml, the report's dependency, and every
    dependency's hash: DVC has no setting that hides them), hence the documented command."""
    repo = fake_stage_repo(tmp_path_factory.mktemp("exp_show") / "repo")
    _dvc(repo, "exp", "run", "-q", "-n", "seed-1", "-S", "train.seed=1")
    _dvc(repo, "exp", "run", "-q", "-n", "lr5e-4", "-S", "train.seed=0", "-S", "train.optimizer.lr=0.0005")
    return repo


def test_the_declared_metrics_are_the_headline_and_dvclives_summary(repo):
    show = json.loads(_dvc(repo, "exp", "show", "--json"))
    exps = [rev["data"] for b in show for e in [b, *(b.get("experiments") or [])] for rev in (e.get("revs") or [e])
            if rev.get("data")]
    assert len(exps) >= 3
    for data in exps:
        assert sorted(data["metrics"]) == ["metrics/headline.json", "metrics/train/metrics.json"]
        assert list(data["metrics"]["metrics/headline.json"]["data"]) == HEADLINE


def test_the_documented_table_has_the_headline_and_the_params_that_differ(repo):
    rows = list(csv.DictReader(io.StringIO(_dvc(repo, *TABLE, "--csv"))))
    meta = {"Experiment", "rev", "typ", "Created", "parent"}
    # the headline accuracies, then the params that differ; none of dvclive's statistics, though every
    # one differs (its two accuracies are the last step's rollouts and validation, not the headline's)
    assert [c for c in rows[0] if c not in meta] == [*HEADLINE_COLUMNS, "train.seed", "train.optimizer.lr"]
    by_name = {r["Experiment"]: r for r in rows if r["Experiment"]}
    assert [by_name["seed-1"][k] for k in ("train.seed", "train.optimizer.lr")] == ["1", "0.0003"]
    assert [by_name["lr5e-4"][k] for k in ("train.seed", "train.optimizer.lr")] == ["0", "0.0005"]
    assert float(by_name["seed-1"]["test_accuracy_after"]) == pytest.approx(0.7103)

    table = _dvc(repo, *TABLE, "--no-pager", columns=200)
    assert "…" not in table  # nothing cut: every header and value is whole
    assert max(map(len, table.splitlines())) <= 200
    assert all(h in table for h in (*HEADLINE_COLUMNS, "train.seed", "train.optimizer.lr", "seed-1", "lr5e-4"))


def test_the_whole_table_leads_with_the_headline(repo):
    """``dvc exp show`` as a user first sees it (every column): the metric columns begin with the
    headline accuracies, before dvclive's statistics of the last training step."""
    header = next(csv.reader(io.StringIO(_dvc(repo, "exp", "show", "--csv"))))
    metrics = [c for c in header if c not in {"Experiment", "rev", "typ", "Created", "parent"}]
    assert metrics[:len(HEADLINE_COLUMNS)] == HEADLINE_COLUMNS
    assert "rollout_accuracy" in metrics and "accuracy" not in metrics
