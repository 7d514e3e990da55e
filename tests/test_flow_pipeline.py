"""``flows.pipeline``: ``python -m flows.pipeline`` refuses a busy workspace before Prefect is imported
(the module's import log, ``python -X importtime``, shows no ``prefect``), and the stage timeout's
command-line check. The refusal beside a real ``dvc repro`` and two flows: tests/test_flow_workspace.py."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.pipeline import _parser
from flows.workspace import STAGE_TIMEOUT_S, workspace_lock
from tests.conftest import REPO


def _dvc_repo(path: Path) -> Path:
    path.mkdir()
    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"one": {"cmd": "true"}}}))
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=path, check=True, capture_output=True)
    return path


def test_a_busy_workspace_is_refused_before_prefect_is_imported(tmp_path):
    ws = _dvc_repo(tmp_path / "ws")
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    with workspace_lock(ws):  # this test process is "another flow" running there
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "flows.pipeline", "--workdir", str(ws)],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith(f"flow: error: workspace {ws} is busy: PID {os.getpid()} "), errors
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "flows.workspace" in imported and not [m for m in imported if m.split(".")[0] == "prefect"]


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
@pytest.mark.parametrize(("argv", "key"), [(["--set", "train.nonexistent=1"], "train.nonexistent"),
                                           (["--set", "train.seed=2", "--set", "train.steps=forty"], "train.steps"),
                                           ([], "lora.rank")])
def test_bad_params_are_refused_in_one_line_before_prefect_is_imported(tmp_path, argv, key):
    """A bad ``--set`` (or a bad params.yaml) is one ``flow: error:`` line naming the key, with params.yaml
    as it was: answered before Prefect is imported (the import log shows no ``prefect``), so no Prefect
    server was started for it."""
    ws = _dvc_repo(tmp_path / "ws")
    shutil.copy(REPO / "dvc.yaml", ws / "dvc.yaml")  # this project's stages: check_params first
    text = (REPO / "params.yaml").read_text()
    if not argv:  # a hand edit of params.yaml
        text = text.replace("\n  rank: ", "\n  rank: 0 #", 1)
    (ws / "params.yaml").write_text(text)
    env = {**os.environ, "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "flows.pipeline", "--workdir", str(ws), *argv],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in proc.stderr.splitlines() if not line.startswith("import time:")]
    assert proc.returncode == 2 and len(errors) == 1, proc.stderr[-3000:]
    assert errors[0].startswith("flow: error: ") and f"{key}: " in errors[0], errors
    imported = {line.split("|")[-1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "grpo.config.params" in imported and not [m for m in imported if m.split(".")[0] == "prefect"]
    assert (ws / "params.yaml").read_text() == text and not (ws / ".dvc" / "tmp" / "grpo-flow.lock").exists()


def test_every_option_has_help():
    assert all(a.help for a in _parser()._actions)


def test_stage_timeout_option():
    assert _parser().parse_args([]).stage_timeout == STAGE_TIMEOUT_S
    assert _parser().parse_args(["--stage-timeout", "90"]).stage_timeout == 90.0
    with pytest.raises(SystemExit):
        _parser().parse_args(["--stage-timeout", "0"])
