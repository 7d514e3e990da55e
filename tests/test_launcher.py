"""``grpo.training.launcher.launch_processes`` on real processes (``python -c``, no training): the rank and
exit code of a process that fails, and the hung rank when another timed out in a collective. The
train stage's own launch (a rank killed, a rank that hangs) runs in tests/test_distributed.py."""

from __future__ import annotations

import os

import pytest

from grpo.core.distributed import LAUNCHER_PID, TIMEOUT_EXIT_CODE
from grpo.training.launcher import LaunchFailed, launch_processes


@pytest.fixture(autouse=True)
def _environment(monkeypatch):
    """launch_processes sets these in its own process: restored after each test."""
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv(LAUNCHER_PID, "0")


def _ranks(code: str) -> list[str]:
    """The python arguments of a worker that runs ``code`` with ``rank`` (its RANK) defined."""
    return ["-c", f"import os, sys, time; rank = int(os.environ['RANK']); {code}"]


def test_every_process_exits_0_and_the_launch_returns(tmp_path):
    launch_processes(2, _ranks(f"open(r'{tmp_path}/' + str(rank), 'w').write(os.environ['{LAUNCHER_PID}'])"), 5.0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["0", "1"]
    assert {p.read_text() for p in tmp_path.iterdir()} == {str(os.getpid())}  # they die with this process


def test_a_failed_process_is_named_with_its_exit_code():
    with pytest.raises(LaunchFailed) as err:
        launch_processes(2, _ranks("sys.exit(3 if rank == 1 else 0)"), 5.0)
    assert err.value.code == 3
    assert str(err.value) == ("training process rank 1 failed (exit code 3); the launcher stopped the other 1 "
                              "process(es); see rank 1's output above")


def test_a_timeout_names_the_rank_still_running_as_hung():
    with pytest.raises(LaunchFailed) as err:
        launch_processes(2, _ranks(f"sys.exit({TIMEOUT_EXIT_CODE}) if rank == 0 else time.sleep(600)"), 2.0)
    assert err.value.code == TIMEOUT_EXIT_CODE
    assert str(err.value) == ("training process rank 1 hung: rank 0 timed out waiting for it in a collective "
                              "(train.distribution.dist_timeout_s = 2 s); the launcher stopped every process")
