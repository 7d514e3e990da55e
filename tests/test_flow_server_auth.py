"""Talking to a Prefect server: credentials beyond loopback (``flows.server_auth``), refused in one
line by ``flows.deploy`` and ``flows.pipeline``; a stage's interpreter (``flows.dvc_flow.stage_env``)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from flows.server_auth import ALLOW_FLAG, is_loopback, unauthenticated_remote
from tests.conftest import REPO


@pytest.mark.parametrize(("host", "loopback"), [("127.0.0.1", True), ("127.8.0.1", True), ("localhost", True),
                                                ("::1", True), ("0.0.0.0", False), ("10.0.0.5", False),
                                                ("prefect.example.org", False), (None, False)])
def test_loopback_hosts(host, loopback):
    assert is_loopback(host) is loopback


def test_only_a_remote_url_without_credentials_is_refused():
    remote = "http://10.0.0.5:4200/api"
    line = unauthenticated_remote(remote, None, None)
    assert line and "\n" not in line and "PREFECT_API_AUTH_STRING" in line and ALLOW_FLAG in line
    assert unauthenticated_remote(remote, "user:secret", None) is None
    assert unauthenticated_remote(remote, None, "pnu_key") is None
    assert unauthenticated_remote("http://127.0.0.1:4200/api", None, None) is None
    assert unauthenticated_remote("http://[::1]:4200/api", None, None) is None
    assert unauthenticated_remote(None, None, None) is None


def _bare(env: dict) -> dict:
    return {k: v for k, v in env.items() if not k.startswith("PREFECT_")}


@pytest.mark.slow  # each command imports Prefect: several seconds on 2 cores
@pytest.mark.parametrize("command", [["flows.deploy", "--pool", "grpo-pool"], ["flows.pipeline", "--stages", "report"]])
def test_our_commands_refuse_a_remote_server_without_credentials(command, tmp_path):
    env = {**_bare(os.environ), "PREFECT_API_URL": "http://10.255.255.1:4200/api", "PREFECT_HOME": str(tmp_path),
           "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", *command], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode != 0
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not on loopback" in lines[0] and ALLOW_FLAG in lines[0], proc.stderr


def test_a_stage_runs_with_the_flows_own_interpreter_first_on_path(monkeypatch):
    """stage_env: the directory of this interpreter first on PATH, once, whatever PATH held."""
    from flows.dvc_flow import stage_env

    bindir = str(Path(sys.executable).parent)
    monkeypatch.setenv("PATH", os.pathsep.join(["/usr/bin", bindir, "/bin"]))
    assert stage_env()["PATH"].split(os.pathsep) == [bindir, "/usr/bin", "/bin"]
    monkeypatch.setenv("PATH", "/usr/bin")
    assert shutil.which("python", path=stage_env()["PATH"]) == str(Path(bindir) / "python")
