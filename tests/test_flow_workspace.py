"""The flow beside a real ``dvc repro``, two flows at once, and ran/skipped taken from DVC's state.

Each test builds a temporary git + DVC repo whose stages are shell commands (``cat``, ``sleep``), so
DVC really runs, locks and records them without any ML code. ``python -m flows.pipeline`` runs as a
subprocess from this checkout with ``--workdir`` on that repo and Prefect's ephemeral server.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from flows import workspace
from flows.workspace import FLOW_LOCK, WorkspaceBusy, dvc_command, find_dvc_run, workspace_lock
from tests.conftest import REPO

REFUSAL_S = 15  # a refused flow must end this fast: it never starts Prefect


@pytest.fixture(scope="module")
def prefect_home(tmp_path_factory):
    return tmp_path_factory.mktemp("prefect-home")


def _env(prefect_home: Path | None = None) -> dict:
    env = {**os.environ, "WANDB_MODE": "disabled", "DVC_NO_ANALYTICS": "1", "PYTHONPATH": "",
           "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"
    env.pop("PREFECT_API_URL", None)
    if prefect_home is not None:
        env["PREFECT_HOME"] = str(prefect_home)
    return env


def make_repo(path: Path, sleep: float = 0) -> Path:
    """A git + DVC repo with the chain one -> two -> three (``two`` also reads ``two.txt``)."""
    pause = f"sleep {sleep} && " if sleep else ""
    stages = {
        "one": {"cmd": f"{pause}cat src.txt > a.txt", "deps": ["src.txt"], "outs": ["a.txt"]},
        "two": {"cmd": f"{pause}cat a.txt two.txt > b.txt", "deps": ["a.txt", "two.txt"], "outs": ["b.txt"]},
        "three": {"cmd": f"{pause}cat b.txt b.txt > c.txt", "deps": ["b.txt"], "outs": ["c.txt"]},
    }
    path.mkdir(parents=True)
    (path / "dvc.yaml").write_text(yaml.safe_dump({"stages": stages}, sort_keys=False))
    (path / "params.yaml").write_text("unused: 1  # a flow refused must leave this file alone\n")
    (path / "src.txt").write_text(f"src {time.time_ns()}\n")  # unique: DVC's run cache cannot restore it
    (path / "two.txt").write_text("two\n")
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "ci@example.com"], ["git", "config", "user.name", "ci"],
                [sys.executable, "-m", "dvc", "init", "-q"], [sys.executable, "-m", "dvc", "config", "core.analytics", "false"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "chain"]):
        subprocess.run(cmd, cwd=path, check=True, capture_output=True, env=_env())
    return path


def _flow(repo: Path, prefect_home: Path, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "flows.pipeline", "--workdir", str(repo), *args], cwd=REPO,
                            env=_env(prefect_home), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float = 300) -> tuple[int, str, str, float]:
    t0 = time.monotonic()
    out, err = proc.communicate(timeout=timeout)
    return proc.returncode, out, err, time.monotonic() - t0


def _refused(repo: Path, prefect_home: Path, other_pid: int) -> str:
    """Run the flow, assert it is refused at once with one line naming ``other_pid``; return its time and line."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "flows.pipeline", "--workdir", str(repo)], cwd=REPO,
                          env=_env(prefect_home), capture_output=True, text=True, timeout=120)
    wall = time.monotonic() - t0
    assert proc.returncode == 2, (proc.returncode, proc.stdout[-2000:], proc.stderr[-3000:])
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flow: error: "), proc.stderr[-3000:]
    assert f"PID {other_pid} " in lines[0] and str(repo) in lines[0], lines[0]
    assert wall < REFUSAL_S, f"refused after {wall:.1f} s"
    return f"({wall:.2f} s) {lines[0]}"


def _statuses(stdout: str) -> dict[str, str]:
    return {p[0]: p[1] for p in (line.split() for line in stdout.splitlines()) if len(p) == 4 and p[3] == "s"}


def _snapshot(repo: Path) -> dict[str, tuple[int, bytes]]:
    return {name: ((repo / name).stat().st_mtime_ns, (repo / name).read_bytes())
            for name in ("params.yaml", "dvc.yaml", "src.txt", "two.txt") if (repo / name).exists()}


def _rwlock(repo: Path) -> dict | None:
    try:
        return json.loads((repo / ".dvc/tmp/rwlock").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return None


def _dvc_lock_held(repo: Path) -> bool:
    import fcntl

    try:
        fd = os.open(repo / ".dvc/tmp/lock", os.O_RDONLY)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    else:
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    finally:
        os.close(fd)


def _wait_for(pred, timeout: float, what: str, step: float = 0.05):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(step)
    raise AssertionError(f"timed out waiting for {what}")


def _stop_between_stages(repro: subprocess.Popen, repo: Path, timeout: float = 60) -> bool:
    """Freeze ``repro`` (SIGSTOP) in the gap after stage ``one``: DVC holds .dvc/tmp/lock, no rwlock entry."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and repro.poll() is None:
        if (repo / "a.txt").exists() and not (repo / "c.txt").exists() and _rwlock(repo) == {} and _dvc_lock_held(repo):
            os.kill(repro.pid, signal.SIGSTOP)
            if _rwlock(repo) == {} and _dvc_lock_held(repo) and not (repo / "c.txt").exists():
                return True
            os.kill(repro.pid, signal.SIGCONT)
        time.sleep(0.001)
    return False


def test_dvc_command_recognises_writing_dvc_invocations():
    assert dvc_command(["/v/bin/python", "/v/bin/dvc", "repro"]) == ("repro", None)
    assert dvc_command(["python", "-m", "dvc", "--cd", "sub", "exp", "run", "-S", "a=1"]) == ("exp run", "sub")
    assert dvc_command(["dvc", "-q", "repro", "--single-item", "train"]) == ("repro", None)
    assert dvc_command(["dvc", "status"]) is None and dvc_command(["dvc", "exp", "show"]) is None
    assert dvc_command(["python", "-m", "flows.pipeline"]) is None and dvc_command(["vim", "x", "y", "z", "dvc"]) is None


def test_flow_lock_is_reentrant_within_a_process(tmp_path):
    repo = make_repo(tmp_path / "ws")
    probe = ("import sys; from flows.workspace import workspace_lock, WorkspaceBusy\n"
             "try:\n    workspace_lock(sys.argv[1]).__enter__()\nexcept WorkspaceBusy as e:\n    print(e); sys.exit(2)\n")

    def other_process() -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", probe, str(repo)], cwd=REPO, env=_env(), capture_output=True,
                              text=True, timeout=60)

    with workspace_lock(repo):
        with workspace_lock(repo):  # main() then the flow function, in one process
            assert (repo / ".dvc/tmp" / FLOW_LOCK).exists()
        held = other_process()  # the inner exit must not have released the outer hold
        assert held.returncode == 2 and f"PID {os.getpid()} " in held.stdout, held.stdout + held.stderr
    assert not (repo / ".dvc/tmp" / FLOW_LOCK).exists()
    assert other_process().returncode == 0


@pytest.mark.slow
def test_flow_refused_beside_a_running_dvc_repro(tmp_path, prefect_home):
    repo = make_repo(tmp_path / "ws", sleep=3)
    expected = (repo / "src.txt").read_text() + "two\n"
    before = _snapshot(repo)
    repro = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=repo, env=_env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True)
    try:
        # 1. DVC starting: no lock taken yet, only the process table shows it
        time.sleep(0.05)
        os.kill(repro.pid, signal.SIGSTOP)
        try:
            if not _dvc_lock_held(repo) and not _rwlock(repo):
                print("\nrefused while DVC starts:", _refused(repo, prefect_home, repro.pid))
            else:
                print("DVC had taken its lock before it was frozen")
        finally:
            os.kill(repro.pid, signal.SIGCONT)
        # 2. during stage one: DVC has released .dvc/tmp/lock and holds the stage's paths in .dvc/tmp/rwlock
        _wait_for(lambda: str(repro.pid) in json.dumps(_rwlock(repo) or {}) and not _dvc_lock_held(repo), 60,
                  "stage one to run")
        holder = workspace._rwlock_holders(repo.resolve(), own=set())
        assert holder is not None and holder.pid == repro.pid  # the rwlock detector alone sees it
        line = _refused(repo, prefect_home, repro.pid)
        assert _snapshot(repo) == before and not (repo / ".dvc/tmp" / FLOW_LOCK).exists()
        assert not (repo / "b.txt").exists() and repro.poll() is None  # still in stage one: a real mid-stage refusal
        print("refused during a stage:", line)
        # 3. between stages: DVC holds .dvc/tmp/lock, the rwlock is empty; frozen there to look
        if _stop_between_stages(repro, repo):
            try:
                found = find_dvc_run(repo)
                assert found is not None and found.pid == repro.pid
                holder = workspace._lock_holder(repo / ".dvc/tmp/lock", "holds .dvc/tmp/lock")
                assert holder is not None and holder.pid == repro.pid  # the DVC-lock detector alone sees it
                print("refused between stages:", _refused(repo, prefect_home, repro.pid))
            finally:
                os.kill(repro.pid, signal.SIGCONT)
        else:
            print("the gap between stages was not caught this time")
        out, _ = repro.communicate(timeout=120)
    finally:
        if repro.poll() is None:
            os.kill(repro.pid, signal.SIGCONT)
            repro.kill()
            repro.wait()
    # the repro was not disturbed: it ran every stage and recorded them
    assert repro.returncode == 0, out[-3000:]
    assert [ln.split("'")[1] for ln in out.splitlines() if ln.startswith("Running stage '")] == ["one", "two", "three"]
    assert (repo / "c.txt").read_text() == expected * 2
    assert set(yaml.safe_load((repo / "dvc.lock").read_text())["stages"]) == {"one", "two", "three"}
    assert _snapshot(repo) == before and not (repo / ".dvc/tmp" / FLOW_LOCK).exists()
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=repo, env=_env(),
                            capture_output=True, text=True, check=True)
    assert json.loads(status.stdout) == {}


@pytest.fixture(scope="module")
def flow_repo(tmp_path_factory):
    return make_repo(tmp_path_factory.mktemp("flows") / "ws")


@pytest.mark.slow
def test_two_flows_started_together_one_runs(flow_repo, prefect_home):
    before = _snapshot(flow_repo)
    t0 = time.monotonic()
    procs = [_flow(flow_repo, prefect_home), _flow(flow_repo, prefect_home)]
    ended: dict[int, float] = {}
    while len(ended) < 2 and time.monotonic() - t0 < 300:
        ended.update({p.pid: time.monotonic() - t0 for p in procs if p.pid not in ended and p.poll() is not None})
        time.sleep(0.05)
    results = {p.pid: _finish(p, timeout=10) for p in procs}
    codes = sorted(code for code, *_ in results.values())
    assert codes == [0, 2], {pid: (r[0], r[2][-2000:]) for pid, r in results.items()}
    winner = next(pid for pid, r in results.items() if r[0] == 0)
    loser = next(pid for pid, r in results.items() if r[0] == 2)
    lines = results[loser][2].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("flow: error: ") and f"PID {winner} " in lines[0], results[loser][2]
    assert "pipeline flow" in lines[0] and ended[loser] < REFUSAL_S, (lines[0], ended)
    print(f"\nloser refused after {ended[loser]:.1f} s: {lines[0]}\nwinner done after {ended[winner]:.1f} s")
    assert _statuses(results[winner][1]) == {"one": "ran", "two": "ran", "three": "ran"}, results[winner][1]
    assert _snapshot(flow_repo) == before and not (flow_repo / ".dvc/tmp" / FLOW_LOCK).exists()


@pytest.mark.slow
def test_second_flow_reports_every_stage_skipped(flow_repo, prefect_home):
    code, out, err, _ = _finish(_flow(flow_repo, prefect_home))
    assert code == 0, err[-3000:]
    assert _statuses(out) == {"one": "skipped", "two": "skipped", "three": "skipped"}, out


@pytest.mark.slow
def test_edited_dependency_reruns_that_stage_and_downstream(flow_repo, prefect_home):
    (flow_repo / "two.txt").write_text(f"two, edited {time.time_ns()}\n")
    code, out, err, _ = _finish(_flow(flow_repo, prefect_home))
    assert code == 0, err[-3000:]
    assert _statuses(out) == {"one": "skipped", "two": "ran", "three": "ran"}, out
    assert list(_statuses(out)) == ["one", "two", "three"]  # dvc.yaml's order


@pytest.mark.slow
def test_unknown_stage_is_one_line_before_anything_runs(flow_repo, prefect_home):
    code, out, err, wall = _finish(_flow(flow_repo, prefect_home, "--stages", "two", "nope"))
    assert code == 2 and err.strip().splitlines() == [err.strip()] and "unknown nope" in err, err
    assert "dvc.yaml has: one, two, three" in err and wall < REFUSAL_S


@pytest.mark.slow
def test_workspace_busy_is_raised_in_process_for_another_flow(flow_repo):
    # the same refusal for a deployment calling the flow function: another process holds the lock
    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from flows.workspace import workspace_lock\n"
                               "with workspace_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n",
                               str(flow_repo)], cwd=REPO, env=_env(), stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(WorkspaceBusy, match=f"PID {holder.pid} "):
            with workspace_lock(flow_repo):
                pass
    finally:
        holder.kill()
        holder.wait()


def test_a_flow_of_named_stages_runs_the_params_check_first():
    """``--stages prepare_data`` alone would find the guard's stamp missing (every stage depends on
    it): the guard stages of dvc.yaml join any selection, in dvc.yaml's order."""
    from flows.workspace import guard_stages, select_stages, stages_of

    guards = guard_stages(REPO)
    assert guards == ["check_params"]
    assert select_stages(stages_of(REPO), ["prepare_data"], guards) == ["check_params", "prepare_data"]
    assert select_stages(["a", "b"], ["b"]) == ["b"]  # a workspace without a guard: as asked
