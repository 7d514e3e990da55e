"""A process work pool and a real worker on a real local Prefect server: two runs of the same workspace
queue on its Prefect concurrency slot; without the slot the second one fails as busy.

The workspace is a git + DVC repo with one ``always_changed`` stage that appends ``<flow run id> start
<time>``, sleeps, then appends ``<flow run id> end <time>`` to a log outside the workspace, so every run
really runs it and the log shows when each run held the workspace. It holds a copy of this checkout's
``flows/`` and ``prefect.yaml``: the deployments' source is the workspace itself, as on a real worker
machine. Two deployments of it (``prefect deploy`` with ``prefect.yaml``, and ``python -m flows.deploy
--pool``) and ``prefect worker start --pool grpo-pool`` as subprocesses, as the README documents.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from flows.pipeline import SLOT_ENV, slot_name
from tests.conftest import REPO

pytestmark = pytest.mark.slow

POOL = "grpo-pool"
STAGE_S = 3  # the stage's sleep: long enough that two runs started together overlap without the slot


def _env(base: dict) -> dict:
    env = {**base, "DVC_NO_ANALYTICS": "1", "PYTHONPATH": "", "PREFECT_WORKER_QUERY_SECONDS": "1"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    return env


def _sh(cmd: list[str], cwd: Path, env: dict, timeout: float = 120) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc.stdout


def make_stamp_workspace(ws: Path, stamps: Path, env: dict) -> Path:
    stage = {"cmd": f'echo "$PREFECT__FLOW_RUN_ID start $(date +%s.%N)" >> {stamps} && sleep {STAGE_S} && '
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


def _post(api: str, path: str, body: dict) -> httpx.Response:
    response = httpx.post(f"{api}{path}", json=body, timeout=10)
    response.raise_for_status()
    return response


def _deployment(api: str, name: str) -> dict:
    found = [d for d in _post(api, "/deployments/filter", {}).json() if d["name"] == name]
    assert len(found) == 1, f"deployment {name} registered {len(found)} times"
    return found[0]


def _wait_final(api: str, ids: list[str], worker: subprocess.Popen, timeout: float = 180) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        runs = {r["id"]: r for r in _post(api, "/flow_runs/filter", {"flow_runs": {"id": {"any_": ids}}}).json()}
        if all(runs[i]["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED", "CANCELLED") for i in ids):
            return runs
        assert worker.poll() is None, f"the worker exited ({worker.returncode})"
        assert time.monotonic() < deadline, {i: runs[i]["state"]["name"] for i in ids}
        time.sleep(0.5)


def _logs(api: str, run_id: str) -> str:
    logs = _post(api, "/logs/filter", {"logs": {"flow_run_id": {"any_": [run_id]}}, "sort": "TIMESTAMP_ASC"}).json()
    return "\n".join(entry["message"] for entry in logs)


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
    stamps = base / "stamps.log"
    ws = make_stamp_workspace(base / "ws", stamps, env)
    api = prefect_server["api"]
    prefect = [sys.executable, "-m", "prefect"]
    t0 = time.monotonic()
    _sh([*prefect, "work-pool", "create", POOL, "--type", "process"], ws, env)
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
        print(f"\npool created, deployed twice, worker started in {time.monotonic() - t0:.1f} s")
        yield {"api": api, "ws": ws, "stamps": stamps, "worker": worker,
               "by_flows_deploy": _deployment(api, "ci-pool"), "by_prefect_yaml": _deployment(api, "grpo-nightly")}
    finally:
        worker.terminate()  # SIGTERM: the worker stops polling and exits
        try:
            worker.wait(timeout=30)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
        worker_log.close()


def test_deployments_run_the_workspace_code_on_the_pool(pool_setup):
    ws = str(pool_setup["ws"].resolve())
    pulled = {"prefect.deployments.steps.set_working_directory": {"directory": ws}}
    for dep in (pool_setup["by_flows_deploy"], pool_setup["by_prefect_yaml"]):
        assert dep["work_pool_name"] == POOL and dep["entrypoint"] == "flows/pipeline.py:pipeline", dep
        assert dep["pull_steps"] == [pulled] and dep["parameters"] == {"workdir": "."}, dep
    assert [s["schedule"]["cron"] for s in pool_setup["by_prefect_yaml"]["schedules"]] == ["0 3 * * *"]
    assert [s["schedule"]["cron"] for s in pool_setup["by_flows_deploy"]["schedules"]] == ["0 3 1 1 *"]


def test_two_runs_of_one_workspace_queue_on_its_slot(pool_setup):
    api, worker = pool_setup["api"], pool_setup["worker"]
    t0 = time.monotonic()
    # one run of each deployment, back to back: two deployments, one workspace, one slot
    ids = [_post(api, f"/deployments/{pool_setup[dep]['id']}/create_flow_run", {}).json()["id"]
           for dep in ("by_prefect_yaml", "by_flows_deploy")]
    runs = _wait_final(api, ids, worker)
    wall = time.monotonic() - t0
    assert [runs[i]["state"]["type"] for i in ids] == ["COMPLETED", "COMPLETED"], \
        {i: (runs[i]["state"]["name"], _logs(api, i)[-2000:]) for i in ids}
    stamps = _stamps(pool_setup["stamps"])
    assert set(stamps) == set(ids) and all(set(s) == {"start", "end"} for s in stamps.values()), stamps
    first, second = sorted(ids, key=lambda i: stamps[i]["start"])
    gap = stamps[second]["start"] - stamps[first]["end"]
    assert gap >= 0, f"the runs overlapped in the workspace: {stamps}"
    logs = {i: _logs(api, i) for i in ids}
    assert "waiting for the slot" in logs[second] and "took the workspace slot" in logs[second], logs[second]
    assert "waiting for the slot" not in logs[first], logs[first]
    waited = next(line for line in logs[second].splitlines() if line.startswith("took the workspace slot"))
    limit = httpx.get(f"{api}/v2/concurrency_limits/{slot_name(pool_setup['ws'])}", timeout=10).json()
    assert limit["limit"] == 1 and limit["active_slots"] == 0, limit  # released by both
    print(f"\nfirst  {first}: stage {stamps[first]['start']:.2f} -> {stamps[first]['end']:.2f}"
          f"\nsecond {second}: stage {stamps[second]['start']:.2f} -> {stamps[second]['end']:.2f}"
          f" ({gap:.2f} s after the first's end; {waited})\nboth completed {wall:.1f} s after creation")


def test_without_the_slot_the_second_run_fails_busy(pool_setup):
    api, worker = pool_setup["api"], pool_setup["worker"]
    pool_setup["stamps"].unlink(missing_ok=True)
    dep = pool_setup["by_flows_deploy"]["id"]
    off = {"job_variables": {"env": {SLOT_ENV: "off"}}}  # the runs' environment: no workspace slot
    ids = [_post(api, f"/deployments/{dep}/create_flow_run", off).json()["id"] for _ in range(2)]
    runs = _wait_final(api, ids, worker)
    states = {i: runs[i]["state"]["type"] for i in ids}
    assert sorted(states.values()) == ["COMPLETED", "FAILED"], {i: (states[i], _logs(api, i)[-2000:]) for i in ids}
    failed = next(i for i in ids if states[i] == "FAILED")
    done = next(i for i in ids if states[i] == "COMPLETED")
    busy = [line for line in _logs(api, failed).splitlines() if "is busy" in line]
    assert busy and "is busy: PID " in busy[0], _logs(api, failed)[-3000:]
    assert set(_stamps(pool_setup["stamps"])) == {done}  # the refused run never started the stage
    print(f"\nwithout the slot: {done} COMPLETED, {failed} FAILED: {busy[0][:300]}")


def test_slot_name_is_per_workspace_path(tmp_path):
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link")
    assert slot_name(tmp_path / "a") == slot_name(tmp_path / "link") != slot_name(tmp_path)
    assert slot_name(tmp_path).startswith("grpo-workspace-")
