"""``flows.process``: a command past its timeout is stopped with every process under it (one that
started a session of its own, one that ignores SIGTERM), and a command that ends in time is logged line
by line. Real shell processes; no Prefect (the flow's stage past its timeout: tests/test_flow_pipeline.py)."""

from __future__ import annotations

import time

import psutil
import pytest

from flows.process import StageTimeout, run_logged, stop_tree


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _pids(path) -> list[int]:
    return [int(x) for x in path.read_text().split()]


def test_a_command_past_its_timeout_is_stopped_with_its_whole_tree(tmp_path):
    # the shell, a child in its group, and a grandchild in a session of its own (as a stage's workers may be)
    script = ("echo $$ > pids; sleep 300 & echo $! >> pids; setsid sleep 300 & echo $! >> pids; "
              "echo started; wait")
    logged: list[str] = []
    t0 = time.monotonic()
    with pytest.raises(StageTimeout) as err:
        run_logged(["sh", "-c", script], tmp_path, 1.5, logged.append, what="stage hang")
    wall = time.monotonic() - t0
    message = str(err.value)
    assert "\n" not in message and message.startswith("stage hang timed out after 1.5 s: stopped it and its "), message
    pids = _pids(tmp_path / "pids")
    assert len(pids) == 3 and not [p for p in pids if _running(p)], pids
    assert logged == ["started"] and wall < 10, (logged, wall)


def test_stop_tree_kills_what_ignores_sigterm(tmp_path):
    import subprocess

    proc = subprocess.Popen(["sh", "-c", "trap '' TERM; echo $$ > pid; while :; do sleep 0.1; done"], cwd=tmp_path,
                            start_new_session=True)
    while not (tmp_path / "pid").exists() or not (tmp_path / "pid").read_text().strip():
        time.sleep(0.05)
    t0 = time.monotonic()
    assert stop_tree(proc.pid, grace_s=0.5) >= 1
    assert proc.wait(timeout=5) is not None and time.monotonic() - t0 >= 0.5


def test_a_command_that_ends_in_time_returns_its_code_and_lines(tmp_path):
    logged: list[str] = []
    code, lines = run_logged(["sh", "-c", "echo one; echo two >&2; exit 3"], tmp_path, 30, logged.append, what="x")
    assert (code, lines, logged) == (3, ["one", "two"], ["one", "two"])

