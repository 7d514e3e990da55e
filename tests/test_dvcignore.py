"""Bytecode is no dependency: the project's ``.dvcignore`` keeps ``__pycache__`` folders out of the
hash DVC records for a directory dependency (``src/grpo/config`` and ``src/grpo/algorithm/kernels`` are
whole-directory deps), so importing the code in a workspace, or not, leaves every stage's lock
entry valid (a fresh clone after ``dvc pull`` runs nothing; a lock made without bytecode does not
go stale once Python has run)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import yaml

from grpo.core.dvcfile import read_stages

from .conftest import REPO


def _directory_deps() -> list[str]:
    """The code directories that some stage of the repo's dvc.yaml depends on as a whole."""
    deps = {d for spec in read_stages(REPO / "dvc.yaml").values() for d in spec.deps}
    return sorted(d for d in deps if d.startswith("src/") and (REPO / d).is_dir())


def _workspace(tmp_path, monkeypatch):
    """A DVC workspace holding a copy of the repo's code and ``.dvcignore``, with one stage that
    depends on every directory dep of the real pipeline; its lock written before any bytecode exists."""
    from dvc.repo import Repo

    ws = tmp_path / "ws"
    shutil.copytree(REPO / "src", ws / "src", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info"))
    shutil.copy(REPO / ".dvcignore", ws / ".dvcignore")
    Repo.init(str(ws), no_scm=True).close()
    monkeypatch.chdir(ws)  # DVC resolves a stage's name against the working directory
    dirs = _directory_deps()
    (ws / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"code": {"cmd": "true", "deps": dirs}}}))
    with Repo(str(ws)) as repo:
        repo.reproduce("code")
    return ws, dirs


def _write_bytecode(ws) -> None:
    """Import every section (as a stage does) and compile the rest, Python writing ``__pycache__``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPATH"] = str(ws / "src")
    code = ("import importlib, pkgutil, grpo.config.sections as s\n"
            "for m in pkgutil.iter_modules(s.__path__): importlib.import_module(f'grpo.config.sections.{m.name}')\n")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=ws)
    subprocess.run([sys.executable, "-m", "compileall", "-q", str(ws / "src")], env=env, check=True)


def test_importing_the_code_leaves_every_directory_dep_unchanged(tmp_path, monkeypatch):
    from dvc.repo import Repo

    ws, dirs = _workspace(tmp_path, monkeypatch)
    assert "src/grpo/config" in dirs
    lock = yaml.safe_load((ws / "dvc.lock").read_text())["stages"]["code"]["deps"]
    for dep in lock:  # the lock counts the sources alone
        assert dep["nfiles"] == sum(1 for p in (ws / dep["path"]).rglob("*") if p.is_file()), dep["path"]
    _write_bytecode(ws)
    assert all(any((ws / d).rglob("*.pyc")) for d in dirs)  # Python did write bytecode there
    with Repo(str(ws)) as repo:
        assert repo.status() == {}
