"""Scheduled runs as an operator sets them up, on real Prefect servers and workers.

- A worker started by its path (``<venv>/bin/prefect worker start``) with the environment off PATH,
  as a systemd unit or a cron line starts it: a deployment run re-runs a stage whose ``python -m``
  needs this project's packages, and the stage writes the same bytes as ``dvc repro`` does.
- A stage that fails in a deployment run: the run fails, its log holds the stage's own lines and one
  line naming the stage and the exit code, no traceback; the next run gets the workspace.
- A server started with ``PREFECT_SERVER_API_AUTH_STRING``: an API call without it is refused (401),
  ``flows.deploy`` and a worker given ``PREFECT_API_AUTH_STRING`` complete a run.
"""

from __future__ import annotations

import base64
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
import yaml

from tests.conftest import REPO, serve_prefect, stop_process
from tests.helpers import api_call as _post
from tests.helpers import prefect_env as _env
from tests.helpers import run_logs as _logs
from tests.helpers import sh as _sh
from tests.helpers import wait_final as _wait_final
from tests.helpers import wait_log as _wait_log

pytestmark = pytest.mark.slow

BIN = Path(sys.executable).parent
LABELS = ("python -c \"import json; from grpo.data.sources import generate_arithmetic; "
          "open('labels.jsonl', 'w').write(''.join(json.dumps(r) + chr(10) for r in generate_arithmetic(20, 1)))\"")
FAIL = ("python -c \"import sys; print('fail: reading the problems'); "
        "print('fail: no problem has an answer', file=sys.stderr); sys.exit(3)\"")


def bare_env(env: dict) -> dict:
    """``env`` as a systemd unit or a cron line gives it: the virtual environment neither on PATH
    nor named (``VIRTUAL_ENV``)."""
    out = {k: v for k, v in env.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    out["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if p and Path(p).resolve() != BIN.resolve())
    return {**out, "DVC_NO_ANALYTICS": "1", "PREFECT_WORKER_QUERY_SECONDS": "5"}


def operator_workspace(ws: Path, env: dict) -> Path:
    """A git + DVC repo with a stage that needs this project's python (``labels``) and one that fails."""
    stages = {"labels": {"cmd": LABELS, "outs": ["labels.jsonl"]}, "fail": {"cmd": FAIL, "always_changed": True}}
    ws.mkdir(parents=True)
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    shutil.copytree(REPO / "flows", ws / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "ci@example.com"], ["git", "config", "user.name", "ci"],
                [sys.executable, "-m", "dvc", "init", "-q"], [sys.executable, "-m", "dvc", "config", "core.analytics", "false"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "operator"]):
        _sh(cmd, ws, env)
    return ws


def _deploy_and_start_worker(ws: Path, server: dict, pool: str, extra: dict) -> tuple[str, subprocess.Popen]:
    """``flows.deploy --pool`` from the workspace, then a worker started by its path in the bare
    environment; the deployment's id and the worker."""
    env = {**_env(server["env"]), **extra}
    _sh([sys.executable, "-m", "prefect", "work-pool", "create", pool, "--type", "process"], ws, env)
    config = ws.parent / "schedule.yaml"  # a cron never due while the test runs
    config.write_text(yaml.safe_dump({"name": "ops", "cron": "0 3 1 1 *", "parameters": {"workdir": "."}}))
    _sh([sys.executable, "-m", "flows.deploy", "--pool", pool, "--config", str(config)], ws, env)
    deployment = next(d for d in _post(server["api"], "/deployments/filter", {}, tries=3, headers=_auth(extra)).json()
                      if d["name"] == "ops")
    log = open(ws.parent / "worker.log", "w")
    worker = subprocess.Popen([str(BIN / "prefect"), "worker", "start", "--pool", pool], cwd=ws.parent,
                              env={**bare_env(server["env"]), **extra}, stdout=log, stderr=subprocess.STDOUT)
    return deployment["id"], worker


def _auth(extra: dict) -> dict:
    secret = extra.get("PREFECT_API_AUTH_STRING")
    return {"Authorization": "Basic " + base64.b64encode(secret.encode()).decode()} if secret else {}


def _run(api: str, deployment_id: str, stages: list[str], extra: dict) -> str:
    body = {"parameters": {"workdir": ".", "stages": stages}}
    return _post(api, f"/deployments/{deployment_id}/create_flow_run", body, headers=_auth(extra)).json()["id"]


def test_a_worker_started_by_its_path_runs_stages_with_the_projects_python(prefect_server, tmp_path):
    env = _env(prefect_server["env"])
    assert shutil.which("python", path=bare_env(env)["PATH"]) != str(BIN / "python")  # the venv is off PATH
    ws = operator_workspace(tmp_path / "ws", env)
    reference = tmp_path / "reference"
    shutil.copytree(ws, reference)
    _sh([sys.executable, "-m", "dvc", "repro", "labels"], reference, env)  # the same stage, by hand
    deployment, worker = _deploy_and_start_worker(ws, prefect_server, "ops-pool", {})
    api = prefect_server["api"]
    try:
        failed = _run(api, deployment, ["fail"], {})
        assert _wait_final(api, [failed], worker)[failed]["state"]["type"] == "FAILED"
        last = _wait_log(api, failed, "stage fail failed: dvc repro --single-item fail exited with", worker)[1]
        log = _logs(api, failed)
        lines = log.splitlines()
        print(f"\nthe failed run's log: {len(lines)} lines; the last ones:\n" + "\n".join(lines[-6:]))
        assert "Traceback" not in log and "fail: no problem has an answer" in log and "fail: reading the problems" in log
        assert last.count("\n") == 0
        done = _run(api, deployment, ["labels"], {})  # the next run gets the workspace
        assert _wait_final(api, [done], worker)[done]["state"]["type"] == "COMPLETED", _logs(api, done)
    finally:
        stop_process(worker)
    assert (ws / "labels.jsonl").read_bytes() == (reference / "labels.jsonl").read_bytes()


def test_a_server_with_an_auth_string_refuses_anonymous_calls_and_serves_its_clients(tmp_path):
    secret = "grpo-ci:a-long-random-secret"
    (tmp_path / "home").mkdir()
    with serve_prefect(tmp_path / "home", {"PREFECT_SERVER_API_AUTH_STRING": secret}) as server:
        api = server["api"]
        assert httpx.post(f"{api}/flow_runs/filter", json={}, timeout=30).status_code == 401
        wrong = {"Authorization": "Basic " + base64.b64encode(b"grpo-ci:guess").decode()}
        assert httpx.post(f"{api}/flow_runs/filter", json={}, headers=wrong, timeout=30).status_code == 401
        extra = {"PREFECT_API_AUTH_STRING": secret}
        ws = operator_workspace(tmp_path / "ws", _env(server["env"]))
        deployment, worker = _deploy_and_start_worker(ws, server, "auth-pool", extra)
        try:
            run = _run(api, deployment, ["labels"], extra)
            final = _wait_final(api, [run], worker, timeout=240, headers=_auth(extra))[run]["state"]["type"]
            assert final == "COMPLETED"
        finally:
            stop_process(worker)
    assert (ws / "labels.jsonl").exists()

