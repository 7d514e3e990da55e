"""The stages a grid's experiments of one seed share (``grpo.evaluation.seed_stages``); the queue that runs
them once per seed is tested end to end in ``tests/test_ablations.py``."""

from __future__ import annotations

import dataclasses
import subprocess
from pathlib import Path

import pytest

from grpo.core.dvcfile import read_stages
from grpo.evaluation.ablations import load_grid
from grpo.evaluation.seed_stages import check_clean, shared_stages

from .helpers import git_dvc_init

ROOT = Path(__file__).resolve().parent.parent


def test_the_mu_grids_shared_stages_are_those_before_train():
    """No variant of the mu grid sets a param of the data, model, SENT or baseline stages: those run
    once per seed; train and what reads its adapter run per experiment; the report reads every param."""
    grid = load_grid(ROOT / "experiments" / "rule_mu_grid.yaml")
    keys = {k for over in grid.variants.values() for k in over}
    assert shared_stages(read_stages(ROOT / "dvc.yaml"), keys) == ["prepare_data", "prepare_model", "sent", "baseline_eval"]
    assert "sent" not in shared_stages(read_stages(ROOT / "dvc.yaml"), keys | {"sent.samples"})
    assert "baseline_eval" not in shared_stages(read_stages(ROOT / "dvc.yaml"), {"data"})  # upstream not shared


def test_a_guard_upstream_holds_no_stage_back():
    """check_params reads every param and every stage depends on its output, but it writes the same
    bytes for every valid variant (``Stage.guard``): the stages after it are shared as before; a stage
    like it that is no guard would make none shared."""
    stages = read_stages(ROOT / "dvc.yaml")
    guard = next(name for name, st in stages.items() if st.guard)
    assert stages[guard].all_params and all(stages[guard].outs[0] in st.deps for n, st in stages.items() if n != guard)
    assert guard not in shared_stages(stages, {"train.seed"})
    unguarded = {**stages, guard: dataclasses.replace(stages[guard], guard=False)}
    assert shared_stages(unguarded, {"train.seed"}) == []


def test_uncommitted_params_are_refused_naming_the_file(tmp_path):
    (tmp_path / "params.yaml").write_text("data: {seed: 0}\n")
    git_dvc_init(tmp_path)
    check_clean(tmp_path, ["params.yaml", "dvc.lock"])  # clean: no error
    (tmp_path / "params.yaml").write_text("data: {seed: 1}\n")
    with pytest.raises(RuntimeError, match="params.yaml: uncommitted changes"):
        check_clean(tmp_path, ["params.yaml", "dvc.lock"])
    subprocess.run(["git", "checkout", "params.yaml"], cwd=tmp_path, check=True)
    (tmp_path / "dvc.lock").write_text("schema: '2.0'\n")  # untracked: restore would delete it
    with pytest.raises(RuntimeError, match="dvc.lock: uncommitted changes"):
        check_clean(tmp_path, ["params.yaml", "dvc.lock"])
