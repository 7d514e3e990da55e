"""``flows.dvc_flow``: the name of a workspace's Prefect concurrency slot, the temporary server that does
not start, a stage past its timeout and past Prefect's task timeout in a real flow run (one line, no
traceback), and the log filter that keeps tracebacks of one-line errors out of Prefect's logs (the flow run
end to end: tests/test_pipeline.py, tests/test_flow_workspace.py; the slot held on a work pool:
tests/test_flow_deploy.py)."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import textwrap
import time

import psutil
import pytest
import yaml

from flows.dvc_flow import RUN_LOGGERS, _retry_unless_busy, slot_name
from flows.process import StageTimeout

from .conftest import REPO, make_dvc_workspace


def test_slot_name_is_per_workspace_path(tmp_path):
    (tmp_path / "a").mkdir()
    os.symlink(tmp_path / "a", tmp_path / "link")
    assert slot_name(tmp_path / "a") == slot_name(tmp_path / "link") != slot_name(tmp_path)
    assert slot_name(tmp_path).startswith("grpo-workspace-")


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_a_temporary_server_that_does_not_start_is_one_line(tmp_path):
    """Prefect's temporary server given no time to start (the timeout the flow otherwise raises to
    fit a busy machine): the flow ends with one line saying what to do, exit code 1, no traceback."""
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


def _hang_workspace(ws):
    """A git + DVC repo with one stage ``hang`` that, while ``hang.flag`` exists, records its shell's PID and
    its workers' (one in a session of its own) and sleeps; else it writes ``out.txt`` at once."""
    cmd = ("if [ -e hang.flag ]; then echo $$ > pids; sleep 600 & echo $! >> pids; setsid sleep 600 & "
           "echo $! >> pids; echo hanging; wait; fi; echo done > out.txt")
    ws.mkdir()
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"hang": {"cmd": cmd, "outs": ["out.txt"]}}}))
    (ws / "hang.flag").touch()
    for argv in (["git", "init", "-q"], ["git", "config", "user.email", "ci@example.com"], ["git", "config", "user.name", "ci"],
                 [sys.executable, "-m", "dvc", "init", "-q"], [sys.executable, "-m", "dvc", "config", "core.analytics", "false"],
                 ["git", "add", "dvc.yaml", ".dvc"], ["git", "commit", "-qm", "hang"]):
        subprocess.run(argv, cwd=ws, check=True, capture_output=True)
    return ws


@pytest.mark.slow
def test_a_stage_past_its_timeout_fails_the_run_stops_its_processes_and_frees_the_workspace(tmp_path):
    """A real flow run (Prefect's temporary server) whose stage hangs past ``--stage-timeout 5``: the run fails
    with one line naming the stage and the timeout, no process of the stage is left, and a next run gets the
    workspace at once and runs the stage."""
    ws = _hang_workspace(tmp_path / "ws")
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "DVC_NO_ANALYTICS": "1",
           "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    env.pop("PREFECT_API_URL", None)

    def flow() -> tuple[subprocess.CompletedProcess, float]:
        t0 = time.monotonic()
        proc = subprocess.run([sys.executable, "-m", "flows.pipeline", "--workdir", str(ws), "--stage-timeout", "5"],
                              cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
        return proc, time.monotonic() - t0

    first, wall = flow()
    assert first.returncode == 1, first.stderr[-3000:]
    errors = [ln for ln in first.stderr.splitlines() if ln.startswith("flow: error:")]
    assert len(errors) == 1, first.stderr[-3000:]  # Prefect's own lines about its server may follow it
    assert "Traceback" not in first.stderr, first.stderr[-3000:]
    line = errors[0]
    assert line.startswith("flow: error: stage hang (dvc repro --single-item hang) timed out after 5 s: stopped it "
                           "and its "), line
    # the flow run's final state, as Prefect logs it
    assert ("Finished in state Failed(\"Flow run encountered an exception: StageTimeout: " + line[len("flow: error: "):]
            in first.stderr), first.stderr[-3000:]
    pids = [int(p) for p in (ws / "pids").read_text().split()]
    left = [p for p in psutil.process_iter(["pid", "cmdline", "status"])
            if p.info["status"] != psutil.STATUS_ZOMBIE and (p.info["pid"] in pids or "sleep 600" in " ".join(
                p.info["cmdline"] or []) or "--single-item hang" in " ".join(p.info["cmdline"] or []))]
    assert len(pids) == 3 and not left, left
    assert not (ws / ".dvc/tmp/grpo-flow.lock").exists() and not (ws / "out.txt").exists()
    print(f"\nfirst run failed after {wall:.1f} s: {line}")

    (ws / "hang.flag").unlink()
    second, wall = flow()
    assert second.returncode == 0, second.stderr[-3000:]
    assert second.stdout.split()[:2] == ["hang", "ran"], second.stdout
    assert (ws / "out.txt").read_text() == "done\n"
    print(f"second run: {second.stdout.strip()} ({wall:.1f} s)")


@pytest.mark.slow
def test_prefects_own_task_timeout_is_the_same_one_line(tmp_path):
    """The backstop: the stage task's Prefect timeout (``stage_timeout_s`` + ``TASK_SLACK_S``) fires while DVC's
    status check hangs (made to sleep here, the slack cut to 1 s): the flow ends with one ``flow: error:`` line
    naming the stage and the limit, exit code 1, no traceback, and the stage (made a network stage, which is
    retried on other failures) is not retried."""
    ws = _hang_workspace(tmp_path / "ws")
    script = tmp_path / "hung_status.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        import flows.dvc_flow as fp
        fp.TASK_SLACK_S = 1.0
        fp.NETWORK_STAGES = {"hang"}
        fp.stage_changed = lambda root, stage: time.sleep(120) or True
        from flows.pipeline import main
        sys.exit(main(["--workdir", sys.argv[1], "--stage-timeout", "2"]))
    """))
    env = {**os.environ, "PREFECT_HOME": str(tmp_path / "prefect"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180", "DVC_NO_ANALYTICS": "1",
           "PYTHONPATH": f"{REPO / 'src'}:{REPO}"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, str(script), str(ws)], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 1, proc.stderr[-3000:]
    errors = [ln for ln in proc.stderr.splitlines() if ln.startswith("flow: error:")]
    assert errors == ["flow: error: stage hang timed out after 3 s: Prefect's task timeout (the flow's stage_timeout_s "
                      "+ 1 s) stopped it; the limit is the flow's stage_timeout_s (python -m flows.pipeline "
                      "--stage-timeout SECONDS)"], proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr and "Retry" not in proc.stderr, proc.stderr[-3000:]


def _logged(err: BaseException) -> str:
    """What Prefect's task-run logger writes for a failure it logs with ``exc_info=True``, as its engine does."""
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(logging.Formatter().format(record))
    logger = logging.getLogger(RUN_LOGGERS[1])
    saved = logger.handlers[:], logger.propagate
    logger.handlers, logger.propagate = [handler], False  # only this handler: no run to send the entry to
    try:
        try:
            raise err
        except type(err):
            logger.error("Task run failed with exception: %r", err, exc_info=True)
    finally:
        logger.handlers, logger.propagate = saved
    return "\n".join(lines)


def test_one_line_errors_are_logged_without_their_traceback():
    quiet = _logged(StageTimeout("stage x timed out after 5 s"))
    assert quiet == "Task run failed with exception: StageTimeout('stage x timed out after 5 s')", quiet
    loud = _logged(ValueError("a bug"))
    assert "Traceback (most recent call last)" in loud and "ValueError: a bug" in loud, loud


def test_a_timed_out_stage_is_not_retried():
    from prefect.states import Failed
    from prefect.task_engine import TaskRunTimeoutError

    assert _retry_unless_busy(None, None, Failed(data=OSError("network")))
    for err in (StageTimeout("stage x timed out"), TaskRunTimeoutError("Scope timed out after 3.0 second(s).")):
        assert not _retry_unless_busy(None, None, Failed(data=err)), err


def test_the_report_artifact_is_one_piece_of_markdown(tmp_path, monkeypatch):
    """``_publish`` hands Prefect the report with its PNGs inlined (``data:`` URIs), the rest of the text as is."""
    import prefect.artifacts

    from flows.dvc_flow import _publish

    made: dict[str, str] = {}
    monkeypatch.setattr(prefect.artifacts, "create_markdown_artifact", lambda md, key, **_: made.__setitem__(key, md))
    monkeypatch.setattr(prefect.artifacts, "create_table_artifact", lambda rows, key, **_: made.__setitem__(key, rows))
    (tmp_path / "reports").mkdir()
    (tmp_path / "reports" / "curves.png").write_bytes(b"\x89PNG curves")
    (tmp_path / "reports" / "report.md").write_text("# GRPO run report\n\n![curves](curves.png)\n\nThe end.\n")
    _publish(tmp_path, [{"stage": "report", "status": "ran", "seconds": 1.0}])
    assert made["grpo-report"] == ("# GRPO run report\n\n![curves](data:image/png;base64,iVBORyBjdXJ2ZXM=)\n\n"
                                   "The end.\n")
    assert made["grpo-stages"] == [{"stage": "report", "status": "ran", "seconds": 1.0}]
