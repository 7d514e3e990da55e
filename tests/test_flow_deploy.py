"""``flows.deploy`` on a real local Prefect server (the session fixture ``prefect_server`` of
tests/conftest.py).

A scheduled deployment served by ``python -m flows.deploy --config``: it registers, and a scheduled run is
created by the server's scheduler, executed by the serving process, and completes.

A process work pool and a real worker on a real local Prefect server: two runs of the same workspace
queue on its Prefect concurrency slot; a run without the slot, at the same moment, fails as busy.
A run whose stage waits past its ``stage_timeout_s`` fails with the timeout's line (its logs on the server
hold no traceback) and frees the slot for the next run.

The workspace is a git + DVC repo with one ``always_changed`` stage that appends ``<flow run id> start
<time>`` to a log outside the workspace, waits until the test opens a gate (a file), then appends
``<flow run id> end <time>``: every run really runs it, the log shows when each run held the
workspace, and the test decides how long the first run holds it (until the second is running, so
waiting for the slot, and a third run without the slot has failed), so the outcome does not hang on
how fast a loaded machine starts processes. The workspace holds a copy of this checkout's ``flows/``
and ``prefect.yaml``: the deployments' source is the workspace itself, as on a real worker machine.
Two deployments of it (``prefect deploy`` with ``prefect.yaml``, and ``python -m flows.deploy --pool``)
and ``prefect worker start --pool grpo-pool`` run as subprocesses, as the README documents.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import psutil
import pytest
import yaml

from flows.dvc_flow import SLOT_ENV, slot_name
from tests.conftest import REPO, make_dvc_workspace
from tests.helpers import TINY_PARAMS
from tests.helpers import (
    api_call as _post,
)
from tests.helpers import (
    prefect_env as _env,
)
from tests.helpers import (
    run_logs as _logs,
)
from tests.helpers import (
    run_states as _states,
)
from tests.helpers import (
    sh as _sh,
)
from tests.helpers import (
    wait_final as _wait_final,
)
from tests.helpers import (
    wait_log as _wait_log,
)
from tests.helpers import (
    wait_until as _wait_until,
)

from .conftest import stop_process

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
        # a served run is a deployment run: it held the workspace's Prefect slot (the work pool tests below)
        _wait_log(api, done["id"], "took the workspace slot grpo-workspace-", serve)
    finally:
        stop_process(serve)  # SIGTERM; SIGKILL when a loaded machine keeps it (a next run may be starting) past 30 s


POOL = "grpo-pool"






def make_stamp_workspace(ws: Path, stamps: Path, gate: Path, env: dict) -> Path:
    stage = {"cmd": f'echo "$PREFECT__FLOW_RUN_ID start $(date +%s.%N)" >> {stamps} && '
                    f'while [ ! -e {gate} ]; do sleep 0.1; done && '
                    f'echo "$PREFECT__FLOW_RUN_ID end $(date +%s.%N)" >> {stamps} && date +%s.%N > out.txt',
             "outs": ["out.txt"], "always_changed": True}
    ws.mkdir(parents=True)
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"stamp": stage}}, sort_keys=False))
    shutil.copytree(REPO / "flows", ws / "flows", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "prefect.yaml", ws / "prefect.yaml")
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "ci@example.com"], ["git", "config", "user.name", "ci"],
                [sys.executable, "-m", "dvc", "init", "-q"], [sys.executable, "-m", "dvc", "config", "core.analytics", "false"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "stamp"]):
        _sh(cmd, ws, env)
    return ws




def _deployment(api: str, name: str) -> dict:
    found = [d for d in _post(api, "/deployments/filter", {}, tries=3).json() if d["name"] == name]
    assert len(found) == 1, f"deployment {name} registered {len(found)} times"
    return found[0]














def _stamps(path: Path) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for line in path.read_text().splitlines() if path.exists() else []:
        run_id, what, when = line.split()
        out.setdefault(run_id, {})[what] = float(when)
    return out


@pytest.fixture(scope="module")
def pool_setup(prefect_server, tmp_path_factory):
    """The workspace, the pool, two deployments of it and a running worker; the worker is stopped at the end."""
    base = tmp_path_factory.mktemp("pool")
    env = _env(prefect_server["env"])
    stamps, gate = base / "stamps.log", base / "gate"
    ws = make_stamp_workspace(base / "ws", stamps, gate, env)
    api = prefect_server["api"]
    prefect = [sys.executable, "-m", "prefect"]
    t0 = time.monotonic()
    _sh([*prefect, "work-pool", "create", POOL, "--type", "process"], ws, env)
    t_pool = time.monotonic() - t0
    config = base / "schedule.yaml"  # a cron that is never due while the test runs
    config.write_text(yaml.safe_dump({"name": "ci-pool", "cron": "0 3 1 1 *", "parameters": {"workdir": "."}}))
    deploys = [subprocess.Popen(cmd, cwd=ws, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
               for cmd in ([sys.executable, "-m", "flows.deploy", "--pool", POOL, "--config", str(config)],
                           [*prefect, "deploy", "--name", "grpo-nightly", "--no-prompt"])]
    worker_log = open(base / "worker.log", "w")
    worker = subprocess.Popen([*prefect, "worker", "start", "--pool", POOL], cwd=base, env=env, stdout=worker_log,
                              stderr=subprocess.STDOUT)
    try:
        for proc in deploys:
            out, _ = proc.communicate(timeout=120)
            assert proc.returncode == 0, f"{proc.args} failed:\n{out[-3000:]}"
        print(f"\npool created in {t_pool:.1f} s, deployed twice by {time.monotonic() - t0:.1f} s")
        yield {"api": api, "ws": ws, "stamps": stamps, "gate": gate, "worker": worker,
               "by_flows_deploy": _deployment(api, "ci-pool"), "by_prefect_yaml": _deployment(api, "grpo-nightly")}
    finally:
        gate.touch()  # a stage still waiting ends
        stop_process(worker)  # SIGTERM: the worker stops polling and exits
        worker_log.close()


def test_deployments_run_the_workspace_code_on_the_pool(pool_setup):
    ws = str(pool_setup["ws"].resolve())
    pulled = {"prefect.deployments.steps.set_working_directory": {"directory": ws}}
    for dep in (pool_setup["by_flows_deploy"], pool_setup["by_prefect_yaml"]):
        assert dep["work_pool_name"] == POOL and dep["entrypoint"] == "flows/dvc_flow.py:pipeline", dep
        assert dep["pull_steps"] == [pulled] and dep["parameters"] == {"workdir": "."}, dep
    assert [s["schedule"]["cron"] for s in pool_setup["by_prefect_yaml"]["schedules"]] == ["0 3 * * *"]
    assert [s["schedule"]["cron"] for s in pool_setup["by_flows_deploy"]["schedules"]] == ["0 3 1 1 *"]


def test_runs_of_one_workspace_queue_on_its_slot_and_fail_busy_without_it(pool_setup):
    api, worker, stamps_log, gate = (pool_setup[k] for k in ("api", "worker", "stamps", "gate"))
    gate.unlink(missing_ok=True)
    stamps_log.unlink(missing_ok=True)
    t0 = time.monotonic()
    # one run of each deployment, back to back: two deployments, one workspace, one slot
    ids = [_post(api, f"/deployments/{pool_setup[dep]['id']}/create_flow_run", {}).json()["id"]
           for dep in ("by_prefect_yaml", "by_flows_deploy")]
    # one run in the stage, holding the workspace until the gate opens; the other one running, so asking for the slot
    first = _wait_until(lambda: next(iter(_stamps(stamps_log)), None), "a run to start the stage", worker)
    second = next(i for i in ids if i != first)
    _wait_until(lambda: _states(api, [second])[second] == "RUNNING", "the second run to start", worker)
    # meanwhile a third run without the slot (its environment turns it off): it meets the busy workspace
    off = {"job_variables": {"env": {SLOT_ENV: "off"}}}
    third = _post(api, f"/deployments/{pool_setup['by_flows_deploy']['id']}/create_flow_run", off).json()["id"]
    final = ("COMPLETED", "FAILED", "CRASHED", "CANCELLED")
    _wait_until(lambda: _states(api, [third])[third] in final, "the run without the slot to end", worker)
    while_held = _states(api, [*ids, third])
    assert list(_stamps(stamps_log)) == [first], "another run started the stage while the first held the workspace"
    gate.touch()
    runs = _wait_final(api, ids, worker)
    wall = time.monotonic() - t0

    assert while_held == {first: "RUNNING", second: "RUNNING", third: "FAILED"}, while_held
    busy = _wait_log(api, third, "is busy: PID ", worker)[1]
    assert [runs[i]["state"]["type"] for i in ids] == ["COMPLETED", "COMPLETED"], \
        {i: (runs[i]["state"]["name"], _logs(api, i)[-2000:]) for i in ids}
    stamps = _stamps(stamps_log)
    assert set(stamps) == set(ids) and all(set(s) == {"start", "end"} for s in stamps.values()), stamps
    gap = stamps[second]["start"] - stamps[first]["end"]
    assert gap >= 0, f"the runs overlapped in the workspace: {stamps}"
    # the second asked for the slot while the first held it, and got it only once the first let it go
    took = {i: _wait_log(api, i, "took the workspace slot", worker) for i in ids}
    waited = float(took[second][1].split(" after ")[1].split()[0])
    assert took[second][0] - waited < stamps[first]["end"] <= took[second][0], (took, stamps)
    said = "waiting for the slot" in _logs(api, second)  # when it found the slot taken before asking for it
    limit = _post(api, f"/v2/concurrency_limits/{slot_name(pool_setup['ws'])}", None, tries=3, method="GET").json()
    assert limit["limit"] == 1 and limit["active_slots"] == 0, limit  # released by both
    print(f"\nwhile the first held the workspace: {while_held}"
          f"\nfirst  {first}: stage {stamps[first]['start']:.2f} -> {stamps[first]['end']:.2f}"
          f"\nsecond {second}: stage {stamps[second]['start']:.2f} -> {stamps[second]['end']:.2f}"
          f" ({gap:.2f} s after the first's end)\nsecond took the slot {took[second][0] - stamps[first]['end']:.2f} s"
          f" after the first's stage ended, having waited {waited:.1f} s (logged that it was waiting: {said});"
          f" both completed {wall:.1f} s after creation\nthird (no slot) FAILED: {busy[:300]}")


def test_a_run_past_its_stage_timeout_fails_and_frees_the_slot(pool_setup):
    """A deployment run with ``stage_timeout_s: 3`` whose stage waits on the closed gate: it fails with the
    timeout's line, its stage's processes are gone, the workspace's slot is free, and the next run completes."""
    api, worker, gate, ws = (pool_setup[k] for k in ("api", "worker", "gate", "ws"))
    gate.unlink(missing_ok=True)
    dep = pool_setup["by_flows_deploy"]["id"]
    hung = _post(api, f"/deployments/{dep}/create_flow_run", {"parameters": {"stage_timeout_s": 3}}).json()["id"]
    assert _wait_final(api, [hung], worker)[hung]["state"]["type"] == "FAILED"
    line = _wait_log(api, hung, "timed out after 3 s", worker)[1]
    assert "stage stamp (dvc repro --single-item stamp) timed out after 3 s: stopped it and its " in line, line
    _wait_log(api, hung, "Flow run encountered an exception: StageTimeout: stage stamp", worker)  # the flow's last
    assert "Traceback" not in _logs(api, hung), _logs(api, hung)[-3000:]  # the run's logs on the server: lines only
    left = [p.pid for p in psutil.process_iter(["cmdline", "status"]) if p.info["status"] != psutil.STATUS_ZOMBIE
            and str(gate) in " ".join(p.info["cmdline"] or [])]
    assert not left, left  # the stage's shell, waiting on the gate, is gone
    limit = _post(api, f"/v2/concurrency_limits/{slot_name(ws)}", None, tries=3, method="GET").json()
    assert limit["active_slots"] == 0, limit
    gate.touch()
    after = _post(api, f"/deployments/{dep}/create_flow_run", {}).json()["id"]
    assert _wait_final(api, [after], worker)[after]["state"]["type"] == "COMPLETED"
    print(f"\nthe hung run: {line[:300]}")
