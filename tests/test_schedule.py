"""A real local Prefect server: the scheduled deployment registers, and a scheduled run is
created by the server's scheduler, executed by the serving process, and completes (the server: the
session fixture ``prefect_server`` of tests/conftest.py)."""

import json
import subprocess
import sys
import time

import httpx
import pytest
import yaml

from tests.conftest import REPO, make_dvc_workspace
from tests.test_pipeline import TINY_PARAMS

pytestmark = pytest.mark.slow


def test_scheduled_deployment_runs_on_the_server(prefect_server, tmp_path, tiny_model_dir):
    params = json.loads(json.dumps(TINY_PARAMS))
    params["model"]["name"] = str(tiny_model_dir)
    ws = make_dvc_workspace(tmp_path / "ws", params)
    config = tmp_path / "schedule.yaml"
    config.write_text(yaml.safe_dump({"name": "ci-every-minute", "cron": "* * * * *", "timezone": "UTC",
                                      "parameters": {"workdir": str(ws), "stages": ["prepare_data"]}}))
    api = prefect_server["api"]
    serve = subprocess.Popen([sys.executable, "-m", "flows.deploy", "--config", str(config)], cwd=REPO,
                             env=prefect_server["env"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deployment, state = None, None
        deadline = time.time() + 200  # a run is due at the next minute mark, then the stage runs
        while time.time() < deadline and state != "COMPLETED":
            time.sleep(3)
            assert serve.poll() is None, serve.stdout.read()[-3000:]
            deps = httpx.post(f"{api}/deployments/filter", json={}, timeout=10).json()
            deployment = next((d for d in deps if d["name"] == "ci-every-minute"), None)
            if deployment is None:
                continue
            runs = httpx.post(f"{api}/flow_runs/filter", timeout=10, json={
                "deployments": {"id": {"any_": [deployment["id"]]}}}).json()
            state = next((r["state_type"] for r in runs if r["state_type"] == "COMPLETED"), None)
        assert deployment is not None, "deployment was never registered"
        assert [s["schedule"]["cron"] for s in deployment["schedules"]] == ["* * * * *"]
        assert state == "COMPLETED", f"no scheduled run completed; runs: {[r['state_type'] for r in runs]}"
        assert runs[0]["auto_scheduled"] or any(r["auto_scheduled"] for r in runs)
        assert (ws / "data/raw/train.jsonl").exists()  # the scheduled run really ran the stage
        done = next(r for r in runs if r["state_type"] == "COMPLETED")
        logs = httpx.post(f"{api}/logs/filter", timeout=10, json={"logs": {"flow_run_id": {"any_": [done["id"]]}}}).json()
        # a served run is a deployment run: it held the workspace's Prefect slot (tests/test_work_pool.py)
        assert any(entry["message"].startswith("took the workspace slot grpo-workspace-") for entry in logs), logs
    finally:
        serve.terminate()
        serve.wait(timeout=30)
