"""``flows.pipeline``: the name of a workspace's Prefect concurrency slot (the flow run end to end:
tests/test_pipeline.py, tests/test_flow_workspace.py; the slot held on a work pool: tests/test_flow_deploy.py)."""

from __future__ import annotations

import os

from flows.pipeline import slot_name


def test_slot_name_is_per_workspace_path(tmp_path):
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link")
    assert slot_name(tmp_path / "a") == slot_name(tmp_path / "link") != slot_name(tmp_path)
    assert slot_name(tmp_path).startswith("grpo-workspace-")


def test_a_temporary_server_that_does_not_start_is_one_line(tmp_path):
    """Prefect's temporary server given no time to start (the timeout the flow otherwise raises to
    fit a busy machine): the flow ends with one line saying what to do, exit code 1, no traceback."""
    import subprocess
    import sys

    from .conftest import REPO, make_dvc_workspace

    ws = make_dvc_workspace(tmp_path / "ws", {})
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "0", "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, "-m", "flows.pipeline", "--workdir", str(ws)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("flow: error:")]
    assert len(errors) == 1, proc.stderr[-2000:]  # Prefect's own INFO lines about the server may surround it
    assert errors[0].startswith("flow: error: Prefect's temporary server did not answer within 0 s"), errors
    assert "Traceback" not in proc.stderr
