"""A stage's ``dvc repro`` as a subprocess with a deadline, and the stop of its whole process tree.

No Prefect import here: ``flows/pipeline.py`` (the fast refusal path) and the tests use it without Prefect.

``run_logged(cmd, cwd, timeout_s, log)`` starts ``cmd`` in a session of its own, hands each line of its
output (stdout and stderr together) to ``log`` and returns its exit code and output lines. When it runs
past ``timeout_s``, or when the caller is interrupted meanwhile (Prefect's task timeout, Ctrl-C), every
process of its tree is stopped by ``stop_tree`` before the error leaves: a timeout raises
``StageTimeout``, anything else is re-raised as it was.

``stop_tree(pid)`` stops ``pid``, its descendants (a stage's workers may start sessions of their own) and
every process group they lead or belong to, except the caller's own group: SIGTERM, then SIGKILL for what
is still running after ``KILL_GRACE_S``. A zombie (ended, not yet reaped by its parent) counts as stopped.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

KILL_GRACE_S = 10.0  # between SIGTERM and SIGKILL: time for a stage's workers to clean up


class StageTimeout(RuntimeError):
    """A stage ran past its timeout; its processes were stopped. The message is one line."""


class StageFailed(RuntimeError):
    """A stage's ``dvc repro`` exited non-zero; its output is already in the log. The message is one line."""


def _tree(pid: int) -> list:
    """``pid`` and its live descendants as psutil processes (empty when ``pid`` is gone)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [root, *root.children(recursive=True)]
    except psutil.Error:
        return []


def _running(procs: list) -> list:
    import psutil

    alive = []
    for p in procs:
        with contextlib.suppress(psutil.Error):
            if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def _signal(procs: list, groups: set[int], sig: int) -> None:
    import psutil

    for group in groups:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(group, sig)
    for p in procs:
        with contextlib.suppress(psutil.Error):
            p.send_signal(sig)


def stop_tree(pid: int, grace_s: float = KILL_GRACE_S) -> int:
    """Stop ``pid``, its descendants and their process groups (never the caller's); the number of processes
    found. Returns once none of them runs (SIGKILL after ``grace_s``)."""
    procs = _tree(pid)
    groups = set()
    for p in procs:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            groups.add(os.getpgid(p.pid))
    groups.discard(os.getpgrp())
    _signal(procs, groups, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while _running(procs) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = _running(procs)
    if left:
        _signal(left, groups, signal.SIGKILL)
        while _running(left):
            time.sleep(0.05)
    return len(procs)


def run_logged(cmd: list[str], cwd: str | Path, timeout_s: float, log: Callable[[str], None],
               what: str, env: dict[str, str] | None = None) -> tuple[int, list[str]]:
    """Run ``cmd`` in ``cwd`` (with ``env``, default this process's) in a new session, ``log`` each
    output line; ``(exit code, lines)``.

    Past ``timeout_s`` seconds its whole tree is stopped and ``StageTimeout`` raised, one line naming
    ``what`` and the timeout; an exception that interrupts the wait stops the tree too, then propagates.
    """
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    lines: list[str] = []
    reader = threading.Thread(target=_read, args=(proc, lines, log), daemon=True)
    reader.start()
    deadline = time.monotonic() + timeout_s
    try:
        while proc.poll() is None:
            if time.monotonic() >= deadline:
                n = stop_tree(proc.pid)
                proc.wait()
                raise StageTimeout(f"{what} timed out after {timeout_s:g} s: stopped it and its {n} processes")
            time.sleep(0.2)
    except BaseException:
        if proc.poll() is None:
            stop_tree(proc.pid)
        proc.wait()
        raise
    reader.join(timeout=5)  # a process the command left behind may still hold the pipe open
    return proc.returncode, lines


def _read(proc: subprocess.Popen, lines: list[str], log: Callable[[str], None]) -> None:
    for line in proc.stdout:
        line = line.rstrip()
        lines.append(line)
        if line and "\r" not in line:
            log(line)
