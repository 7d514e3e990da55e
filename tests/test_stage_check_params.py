"""The check_params stage (``python -m tasks.check_params``): a valid params file writes the same
stamp every time, a bad one is one line naming the key; and, through the real DVC in a workspace that
has run (the real dvc.yaml, check_params real, the other stages' commands faked), a refused
``dvc exp run -S``, ``dvc repro`` after an edit or ``dvc exp run -S +key=value`` leaves every output,
``params.yaml`` and ``dvc status`` as they were."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo.core.dvcfile import read_stages
from grpo.tools.dvcstatus import downstream

from .conftest import REPO
from .helpers import fake_stage_repo, workspace_md5

GUARD = "check_params"


def _check(cwd: Path, *argv: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    return subprocess.run([sys.executable, "-m", "tasks.check_params", *argv], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_a_valid_file_writes_the_same_stamp_and_a_bad_one_is_one_line(tmp_path):
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    assert _check(tmp_path).returncode == 0
    stamp = tmp_path / "metrics" / "params_check.json"
    first = stamp.read_bytes()
    assert json.loads(first) == {"valid": True}
    other = tmp_path / "other.yaml"
    other.write_text("train:\n  steps: 3\n")  # another valid run: the same bytes
    assert _check(tmp_path, "--params", str(other)).returncode == 0 and stamp.read_bytes() == first
    assert stamp.read_bytes() == (REPO / "metrics" / "params_check.json").read_bytes()  # the committed one
    for text, key in (("train:\n  steps: forty\n", "train.steps"), ("train:\n  nonexistent: 1\n", "train.nonexistent"),
                      ("lora:\n  rank: 0\n", "lora.rank")):
        other.write_text(text)
        proc = _check(tmp_path, "--params", str(other))
        assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
        assert proc.stderr.startswith(f"check_params: error: {key}: "), proc.stderr
    assert stamp.read_bytes() == first


def test_the_guard_is_upstream_of_every_stage():
    """Every other stage depends on the guard's output, so DVC runs the guard first in any ``dvc repro``
    or ``dvc exp run`` (of all stages or of one and its upstream) and stops there on a refusal."""
    stages = read_stages(REPO / "dvc.yaml")
    assert stages[GUARD].guard and stages[GUARD].all_params and stages[GUARD].cmd == f"python -m tasks.{GUARD}"
    (stamp,) = stages[GUARD].outs
    assert [n for n, s in stages.items() if stamp not in s.deps] == [GUARD]
    spec = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"][GUARD]
    assert spec["outs"] == [{stamp: {"cache": False, "persist": True}}]  # left in place while the check runs


def test_the_dvc_exp_run_command_lines_it_reads():
    """The ``-S`` values of a ``dvc exp run`` process, however DVC was started (DVC's own parser)."""
    from tasks._exp_params import exp_set_params

    argv = ["/venv/bin/python", "/venv/bin/dvc", "exp", "run", "-S", "a.b=1", "--set-param=c=2", "-Sd=3", "-n", "x"]
    assert exp_set_params(argv) == ["a.b=1", "c=2", "d=3"]
    assert exp_set_params(["python", "-m", "dvc", "exp", "run", "--set-param", "params.yaml:a=1"]) == ["params.yaml:a=1"]
    assert exp_set_params(["python", "-m", "dvc", "exp", "run"]) == []
    assert exp_set_params(["python", "-m", "dvc", "repro"]) is None
    assert exp_set_params(["/bin/sh", "-c", "python -m tasks.check_params"]) is None


def test_dvcs_rewrite_is_dvcs_own():
    """The bytes ``dvc exp run -S`` leaves in params.yaml: DVC's writer re-flows the file (a flow list
    becomes a block list), which is why a refusal cannot simply undo the one value."""
    from tasks._exp_params import dvc_rewrite

    text = "# note\ntrain:\n  steps: 40   # steps\n  ops: [\"+\"]\n"
    out = dvc_rewrite(text, ["train.steps=forty"])
    assert yaml.safe_load(out) == {"train": {"steps": "forty", "ops": ["+"]}} and out != text.replace("40 ", "forty")


# ------------------------------------------------------------------------------- through the real DVC
def _env(repo: Path) -> dict:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "PYTHONPATH": f"{repo / 'src'}:{repo}"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    return env


def _dvc(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=repo, env=_env(repo), capture_output=True,
                          text=True, timeout=600)


def _status(repo: Path) -> dict:
    proc = _dvc(repo, "status", "--json")
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


def _guard_lines(proc: subprocess.CompletedProcess) -> list[str]:
    return [x for x in (proc.stdout + proc.stderr).splitlines() if x.startswith(f"{GUARD}:")]


@pytest.fixture(scope="module")
def ran(tmp_path_factory) -> Path:
    """A workspace after ``dvc repro``, committed: check_params real, the other stages faked."""
    repo = tmp_path_factory.mktemp("guard") / "repo"
    return fake_stage_repo(repo, real=(GUARD,), env=_env(repo))


@pytest.mark.slow
@pytest.mark.parametrize("value", ["train.steps=forty", "+train.nonexistent=1", "train.optimizer.lr=-1"])
def test_a_refused_dvc_exp_run_changes_nothing(ran, value):
    """The guard refuses what ``-S`` wrote into params.yaml before DVC reaches any other stage; the
    outputs, params.yaml (put back: DVC left its rewrite there) and ``dvc status`` are as before."""
    before, status = workspace_md5(ran), _status(ran)
    assert status == {}
    proc = _dvc(ran, "exp", "run", "-S", value)
    after, status_after = workspace_md5(ran), _status(ran)
    assert proc.returncode != 0
    key = value.lstrip("+").split("=")[0]
    (line,) = _guard_lines(proc)
    assert line.startswith(f"check_params: error: {key}: ") and "params.yaml is back as commit" in line, line
    assert "Running stage 'prepare_data'" not in proc.stdout
    assert after == before and status_after == status


@pytest.mark.slow
def test_an_unknown_key_without_plus_is_refused_by_dvc_itself(ran):
    """``-S train.nonexistent=1``: DVC's Hydra override refuses a key params.yaml lacks before it writes
    anything (``dvc/utils/hydra.py:103-116``): nothing changes; its message names the key."""
    before, status = workspace_md5(ran), _status(ran)
    proc = _dvc(ran, "exp", "run", "-S", "train.nonexistent=1")
    status_after = _status(ran)
    assert proc.returncode != 0 and "train.nonexistent" in proc.stderr and not _guard_lines(proc)
    assert workspace_md5(ran) == before and status_after == status


@pytest.mark.slow
def test_dvc_repro_after_a_bad_edit_removes_nothing_and_keeps_the_edit(ran):
    """``dvc repro`` after editing params.yaml by hand: refused in one line, every output as it was, the
    edit kept (it is the user's), ``dvc status`` the same as before the repro."""
    params = ran / "params.yaml"
    committed = params.read_text()
    params.write_text(committed.replace("\n  steps: ", "\n  steps: forty #", 1))
    try:
        before, status = workspace_md5(ran), _status(ran)
        assert GUARD in status and "train" in status
        proc = _dvc(ran, "repro")
        assert proc.returncode != 0
        (line,) = _guard_lines(proc)
        assert line.startswith("check_params: error: train.steps: ") and "back as" not in line, line
        assert workspace_md5(ran) == before and _status(ran) == status
    finally:
        params.write_text(committed)


@pytest.mark.slow
def test_uncommitted_edits_are_left_as_dvc_wrote_them(ran):
    """A workspace with an uncommitted edit of params.yaml: the check refuses ``-S``'s bad value, removes
    no output, and leaves the file as DVC wrote it (the user's edit with the bad value), saying so."""
    params = ran / "params.yaml"
    committed = params.read_text()
    params.write_text(committed.replace("\n  seed: ", "\n  seed: 5 #", 1))  # data.seed, the first seed
    try:
        before = workspace_md5(ran)
        proc = _dvc(ran, "exp", "run", "-S", "train.steps=forty")
        (line,) = _guard_lines(proc)
        assert line.startswith("check_params: error: train.steps: ") and "keeps what `dvc exp run -S` wrote" in line
        kept = yaml.safe_load(params.read_text())
        assert kept["data"]["seed"] == 5 and kept["train"]["steps"] == "forty"
        assert {k: v for k, v in workspace_md5(ran).items() if k != "params.yaml"} == \
            {k: v for k, v in before.items() if k != "params.yaml"}
    finally:
        params.write_text(committed)


@pytest.mark.slow
def test_a_valid_experiment_runs_the_guard_and_only_the_stages_that_read_the_key(ran):
    """The guard's output is the same bytes after a valid change: DVC re-runs what reads the key, not
    every stage that depends on the guard."""
    proc = _dvc(ran, "exp", "run", "-S", "train.seed=1")
    assert proc.returncode == 0, proc.stderr[-2000:]
    stages = read_stages(ran / "dvc.yaml")
    ran_stages = {x.split("'")[1] for x in proc.stdout.splitlines() if x.startswith("Running stage '")}
    readers = {n for n, s in stages.items() if s.all_params or any(p in ("train", "train.seed") for p in s.params)}
    assert GUARD in readers and ran_stages == readers | set(downstream(stages, readers)) and "sent" not in ran_stages


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_a_split_the_source_cannot_fill_is_refused_before_any_stage(tmp_path):
    """seed 003's old data section (all 7473 of GSM8K's train rows for training, params.yaml's
    val_size 200): no validation row can be drawn, so the guard refuses it, naming data.val_size,
    and writes no stamp (grpo.data.split_check, as grpo check)."""
    other = tmp_path / "old_seed003.yaml"
    other.write_text("data:\n  source: gsm8k\n  train_size: 7473\n  test_size: 1319\n")
    proc = _check(tmp_path, "--params", str(other))
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1, proc.stderr
    assert proc.stderr.startswith("check_params: error: data.val_size: "), proc.stderr
    assert not (tmp_path / "metrics" / "params_check.json").exists()
    other.write_text("data:\n  source: gsm8k\n  train_size: 7273\n  test_size: 1319\n")  # the fixed preset's
    assert _check(tmp_path, "--params", str(other)).returncode == 0
