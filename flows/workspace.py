"""One DVC run at a time per workspace: who else is running DVC here, and the pipeline flow's own lock.

No Prefect import here, so a refused run ends before Prefect starts.

``find_dvc_run(root)`` looks for a DVC run in the workspace ``root``, reading and never writing:

* a ``dvc repro`` / ``dvc exp run`` (or another DVC command that writes the workspace: ``checkout``,
  ``pull``, ``commit``, ...) in the process table (psutil, installed with DVC; processes whose
  working directory this user may read) whose working directory (with ``--cd``) lies in ``root``
  and whose DVC repository is ``root``; this sees DVC from its first instant, before it takes any
  lock;
* the live PIDs recorded in ``.dvc/tmp/rwlock``, where DVC names the process that holds a stage's
  deps and outs for the whole stage (entries whose PID is gone are stale and ignored, as DVC does);
* DVC's repository lock ``.dvc/tmp/lock``, which DVC holds between stages (and releases while a
  stage's command runs), tested on a read-only descriptor; a holder that lets go within 3 s (a
  short ``dvc status``) does not count, as DVC itself waits that long for this lock.

The process itself and its descendants (the flow's own ``dvc repro --single-item``) never count.

``workspace_lock(root)`` is the flow's own lock, ``.dvc/tmp/grpo-flow.lock`` (``flock``), held for
the flow's whole run. It records the holder (PID, command line) so a refused run names it, and it
is re-entrant within a process: ``main()`` takes it, then the flow function takes it again (so
deployments that call the flow directly are covered too), and only the outermost exit releases it.
Acquisition refuses with ``WorkspaceBusy`` when another flow holds the lock or ``find_dvc_run``
finds a DVC run. A refused acquisition writes nothing in the workspace: the lock file is created
only once every check passed (and checked again after, for a DVC run that started in between), and
it is removed on release.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import shlex
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from grpo.core.dvcfile import DVC_DIR, DVC_YAML, find_root, read_stages

FLOW_LOCK = "grpo-flow.lock"

# DVC commands that run stages or write the workspace (its outputs, dvc.lock, .dvc/cache).
_WRITING = {"repro", "run", "commit", "checkout", "pull", "add", "remove", "move", "gc", "import", "import-url",
            "import-db", "update", "unprotect", "destroy", "install"}
_WRITING_EXP = {"run", "apply", "save"}


class WorkspaceBusy(RuntimeError):
    """Another DVC run (a ``dvc`` process or another pipeline flow) is using this workspace."""


@dataclass(frozen=True)
class OtherRun:
    """A process using the workspace: its PID, command line and how it was found."""

    pid: int
    cmd: str
    how: str

    def message(self, root: Path) -> str:
        return (f"workspace {root} is busy: PID {self.pid} ({self.cmd}) {self.how}; "
                "wait for it to finish, then start the flow again")


def dvc_stages(root: Path) -> list[str]:
    """The stage names of ``root/dvc.yaml`` in the file's order (the one list of stages)."""
    path = root / DVC_YAML
    if not (root / DVC_DIR).is_dir() or not path.exists():
        raise ValueError(f"{root}: not a DVC workspace (it needs a .dvc folder and a dvc.yaml)")
    stages = read_stages(path)
    templated = [name for name, stage in stages.items() if stage.templated]
    if templated:
        raise ValueError(f"{path}: stages with foreach/matrix are not supported by the flow: {', '.join(templated)}")
    return list(stages)


def _cmdline(pid: int) -> str | None:
    import psutil

    try:
        argv = psutil.Process(pid).cmdline()
    except (psutil.Error, OSError):
        return None
    return shlex.join(argv) if argv else None


def _pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _own_pids() -> set[int]:
    """This process and its descendants (the flow's own DVC subprocesses)."""
    import psutil

    me = psutil.Process()
    try:
        return {me.pid, *(c.pid for c in me.children(recursive=True))}
    except psutil.Error:
        return {me.pid}


def dvc_command(argv: list[str]) -> tuple[str, str | None] | None:
    """``(subcommand, --cd dir)`` when ``argv`` runs a DVC command that writes the workspace, else None.

    Recognises ``dvc ...``, ``python /path/bin/dvc ...`` (the entry-point script) and ``python -m dvc ...``.
    """
    start = None
    for i, arg in enumerate(argv[:4]):
        if os.path.basename(arg) in ("dvc", "dvc.exe"):
            start = i + 1
            break
        if arg == "-m" and i + 1 < len(argv) and argv[i + 1] == "dvc":
            start = i + 2
            break
        if arg == "-mdvc":
            start = i + 1
            break
    if start is None:
        return None
    words, cd, rest = [], None, iter(argv[start:])
    for arg in rest:
        if arg == "--cd":
            cd = next(rest, None)
        elif arg.startswith("--cd="):
            cd = arg.split("=", 1)[1]
        elif not arg.startswith("-"):
            words.append(arg)
            if words[0] not in ("exp", "experiments") or len(words) == 2:
                break
    if not words:
        return None
    if words[0] in ("exp", "experiments"):
        return (f"exp {words[1]}", cd) if len(words) == 2 and words[1] in _WRITING_EXP else None
    return (words[0], cd) if words[0] in _WRITING else None


def _dvc_processes(root: Path, own: set[int]) -> OtherRun | None:
    import psutil

    for proc in psutil.process_iter(["pid", "cmdline"]):
        argv = proc.info.get("cmdline") or []
        if proc.info["pid"] in own or not argv:
            continue
        found = dvc_command(argv)
        if found is None:
            continue
        try:
            cwd = Path(proc.cwd())
        except (psutil.Error, OSError):
            continue  # another user's process, or it just ended
        where = (cwd / found[1]) if found[1] else cwd
        try:
            where = where.resolve()
        except OSError:
            continue
        if (where == root or root in where.parents) and find_root(where, DVC_DIR) == root:
            return OtherRun(proc.info["pid"], shlex.join(argv), f"runs `dvc {found[0]}` there")
    return None


def _rwlock_holders(root: Path, own: set[int]) -> OtherRun | None:
    path = root / ".dvc" / "tmp" / "rwlock"
    for _ in range(10):  # DVC rewrites the file in place: a read may see it half-written
        try:
            data = json.loads(path.read_text() or "{}")
            break
        except FileNotFoundError:
            return None
        except (json.JSONDecodeError, UnicodeDecodeError):
            time.sleep(0.02)
    else:
        return None
    infos = list((data.get("write") or {}).values())
    for readers in (data.get("read") or {}).values():
        infos.extend(readers if isinstance(readers, list) else [readers])
    for info in infos:
        try:
            pid = int(info["pid"])
        except (KeyError, TypeError, ValueError):
            continue
        if pid not in own and _pid_alive(pid):
            return OtherRun(pid, _cmdline(pid) or str(info.get("cmd")), "holds stage outputs in .dvc/tmp/rwlock")
    return None


def _lock_holder(path: Path, how: str, wait: float = 0.0) -> OtherRun | None:
    """The holder of the flock on ``path`` (tested on a read-only descriptor), or None when it is free.

    With ``wait``, a holder that lets go within that many seconds does not count.
    """
    deadline = time.monotonic() + wait
    while True:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            if err.errno not in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                os.close(fd)
                raise
        else:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
            return None
        os.close(fd)
        if time.monotonic() >= deadline:
            return _describe_holder(path, how)
        time.sleep(0.1)


def _describe_holder(path: Path, how: str) -> OtherRun:
    """The PID and command a lock file records (our JSON record, or the PID zc.lockfile writes)."""
    text = ""
    for _ in range(50):  # a holder writes its record just after taking the lock
        try:
            text = path.read_text().strip()
        except OSError:
            text = ""
        if text:
            break
        time.sleep(0.02)
    pid, cmd = 0, None
    try:
        record = json.loads(text)
        pid, cmd = int(record["pid"]), record.get("cmd")
    except (ValueError, TypeError, KeyError):
        with contextlib.suppress(ValueError):
            pid = int(text.split()[0]) if text else 0
    return OtherRun(pid, (_cmdline(pid) if pid else None) or cmd or "command unknown", how)


def find_dvc_run(root: Path) -> OtherRun | None:
    """Another DVC run in the workspace ``root`` (see the module docstring), or None."""
    root = Path(root).resolve()
    own = _own_pids()
    return (_dvc_processes(root, own) or _rwlock_holders(root, own)
            # a short DVC command (`dvc status`, `dvc exp show`) holds this lock for a moment: DVC
            # itself waits 3 s for it, and so does this check
            or _lock_holder(root / ".dvc" / "tmp" / "lock", "holds DVC's lock .dvc/tmp/lock", wait=3.0))


def check_no_dvc_run(root: Path) -> None:
    """Raise ``WorkspaceBusy`` (one line naming the other run) when ``find_dvc_run`` finds one."""
    other = find_dvc_run(root)
    if other is not None:
        raise WorkspaceBusy(other.message(Path(root).resolve()))


# The flow lock, re-entrant per process: flock locks belong to an open file description, so a second
# open() in the same process would conflict with the first; the registry counts acquisitions instead.
_registry_guard = threading.RLock()
_held: dict[Path, list] = {}  # lock path -> [fd, count]

_FLOW_HOW = "is running the pipeline flow there (holds .dvc/tmp/" + FLOW_LOCK + ")"


def _try_flock(path: Path) -> int | None:
    """The flock on ``path`` (created if missing), or None when another process holds it."""
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as err:
            os.close(fd)
            if err.errno in (errno.EAGAIN, errno.EACCES, errno.EWOULDBLOCK):
                return None
            raise
        try:
            same = os.path.samestat(os.fstat(fd), os.stat(path))
        except FileNotFoundError:
            same = False
        if same:
            return fd
        os.close(fd)  # the previous holder removed the file on release: lock the new one


def _release(path: Path, fd: int) -> None:
    with contextlib.suppress(FileNotFoundError):
        if os.path.samestat(os.fstat(fd), os.stat(path)):
            os.unlink(path)  # under the lock, so a waiter re-opens a fresh file (see _try_flock)
    os.close(fd)


def _acquire(root: Path) -> None:
    path = root / ".dvc" / "tmp" / FLOW_LOCK
    with _registry_guard:
        if path in _held:
            _held[path][1] += 1
            return
        if not (root / ".dvc").is_dir():
            raise ValueError(f"{root}: not a DVC workspace (no .dvc folder)")
        other = _lock_holder(path, _FLOW_HOW)  # read-only checks first: a refused run writes nothing
        if other is None:
            other = find_dvc_run(root)
        if other is not None:
            raise WorkspaceBusy(other.message(root))
        path.parent.mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + 2.0
        while (fd := _try_flock(path)) is None:
            other = _describe_holder(path, _FLOW_HOW)
            if _pid_alive(other.pid) or time.monotonic() > deadline:
                raise WorkspaceBusy(other.message(root))
            time.sleep(0.05)  # the holder just ended, or only tested the lock: try again
        os.ftruncate(fd, 0)
        os.write(fd, json.dumps({"pid": os.getpid(), "cmd": shlex.join([sys.executable, *sys.argv]),
                                 "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}).encode() + b"\n")
        other = find_dvc_run(root)  # a DVC run that started between the first check and the lock
        if other is not None:
            _release(path, fd)
            raise WorkspaceBusy(other.message(root))
        _held[path] = [fd, 1]


def _drop(root: Path) -> None:
    path = root / ".dvc" / "tmp" / FLOW_LOCK
    with _registry_guard:
        entry = _held[path]
        entry[1] -= 1
        if entry[1] == 0:
            del _held[path]
            _release(path, entry[0])


@contextlib.contextmanager
def workspace_lock(root: str | Path) -> Iterator[Path]:
    """Hold the flow lock of the workspace ``root`` (re-entrant); ``WorkspaceBusy`` if another run uses it."""
    root = Path(root).resolve()
    _acquire(root)
    try:
        yield root
    finally:
        _drop(root)


# One stage's limit: long enough for a full training run, short enough that a hung stage frees the
# workspace (and its scheduled runs) within the night of a daily schedule.
STAGE_TIMEOUT_S = 6 * 3600.0


def stages_of(workdir: str | Path) -> list[str]:
    """The workspace's stages in ``dvc.yaml``'s order."""
    return dvc_stages(Path(workdir).resolve())


def guard_stages(workdir: str | Path) -> list[str]:
    """The workspace's guard stages (``meta: {guard: true}`` in ``dvc.yaml``: the params check), which run
    before any stage a flow runs: the stages depend on their outputs."""
    path = Path(workdir).resolve() / DVC_YAML
    return [name for name, stage in read_stages(path).items() if stage.guard] if path.exists() else []


def select_stages(known: list[str], wanted: list[str] | None, guards: list[str] = ()) -> list[str]:
    """``wanted`` and the ``guards`` in ``known``'s order (all of ``known`` when None); ``ValueError``
    naming unknown ones."""
    unknown = [s for s in (wanted or []) if s not in known]
    if unknown:
        raise ValueError(f"stages: unknown {', '.join(unknown)}; dvc.yaml has: {', '.join(known)}")
    return [s for s in known if not wanted or s in wanted or s in guards]
