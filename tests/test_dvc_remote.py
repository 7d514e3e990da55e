"""The shipped DVC remote: ``dvc push`` in one clone, ``dvc pull`` in a fresh ``git clone`` of it,
after which ``dvc repro`` runs nothing.

A tiny real DVC project (two ``python -c`` stages) gets this repo's own ``.dvc/config``, so the
clones use the shipped default remote as a user's would, with ``HOME`` pointed into ``tmp_path``
(the remote's url starts with ``~``). Every stage appends a line to ``../runs.log``, outside its
outputs and outside the clone, so the tests see which stages really ran in which clone.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from grpo.core.dvcfile import read_stages
from tests.conftest import REPO

# stage `raw` writes raw.txt from src.txt; stage `total` sums it into total.json; both log the run
_LOG = "import os; open('../runs.log', 'a').write('{stage} ' + os.path.basename(os.getcwd()) + chr(10))"
STAGES = {
    "raw": {"cmd": f'python -c "{_LOG.format(stage="raw")}; open(\'raw.txt\', \'w\').write(open(\'src.txt\').read() * 2)"',
            "deps": ["src.txt"], "outs": ["raw.txt"]},
    "total": {"cmd": f'python -c "{_LOG.format(stage="total")}; import json; '
                     f'json.dump(dict(total=sum(map(int, open(\'raw.txt\').read().split()))), open(\'total.json\', \'w\'))"',
              "deps": ["raw.txt"], "outs": ["total.json"]},
}


def _env(home: Path) -> dict:
    env = {**os.environ, "HOME": str(home), "DVC_NO_ANALYTICS": "1", "DVC_STUDIO_OFFLINE": "true",
           "GIT_AUTHOR_NAME": "ci", "GIT_AUTHOR_EMAIL": "ci@example.com",
           "GIT_COMMITTER_NAME": "ci", "GIT_COMMITTER_EMAIL": "ci@example.com"}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # the stages' `python`
    for key in ("XDG_CONFIG_HOME", "XDG_CACHE_HOME", "DVC_GLOBAL_CONFIG_DIR", "DVC_SYSTEM_CONFIG_DIR"):
        env.pop(key, None)
    return env


def _run(cwd: Path, env: dict, *cmd: str, check: bool = True) -> subprocess.CompletedProcess:
    if cmd[0] == "dvc":
        cmd = (sys.executable, "-m", "dvc", *cmd[1:])
    proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return proc


def _runs(root: Path, clone: str) -> list[str]:
    log = root / "runs.log"
    lines = log.read_text().splitlines() if log.exists() else []
    return [line.split()[0] for line in lines if line.split()[1] == clone]


def _shipped_remote() -> tuple[str, str]:
    """(name, url as written) of the default remote in this repo's own .dvc/config."""
    import configparser

    cfg = configparser.ConfigParser()
    cfg.read_string((REPO / ".dvc" / "config").read_text())
    name = cfg.get("core", "remote")
    return name, cfg.get(f"'remote \"{name}\"'", "url")


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    """Clone ``a`` with the shipped .dvc/config: ``dvc repro``, ``dvc push``, dvc.lock committed."""
    root = tmp_path_factory.mktemp("remote")
    env = _env(root / "home")
    a = root / "a"
    a.mkdir()
    (a / "dvc.yaml").write_text(yaml.safe_dump({"stages": STAGES}, sort_keys=False))
    (a / "src.txt").write_text("1 2 3\n")
    _run(a, env, "git", "init", "-q")
    _run(a, env, "dvc", "init", "-q")
    (a / ".dvc" / "config").write_text((REPO / ".dvc" / "config").read_text())
    _run(a, env, "git", "add", "-A")
    _run(a, env, "git", "commit", "-qm", "tiny pipeline")
    _run(a, env, "dvc", "repro")
    assert _runs(root, "a") == ["raw", "total"]
    push = _run(a, env, "dvc", "push")
    _run(a, env, "git", "add", "-A")
    _run(a, env, "git", "commit", "-qm", "run")
    return root, env, push.stdout


def test_the_shipped_default_remote_is_a_directory_outside_the_repo():
    name, url = _shipped_remote()
    assert "://" not in url, f"remote {name!r}: {url} needs credentials or a server; a fresh clone must push without setup"
    path = Path(os.path.expanduser(url))
    if not path.is_absolute():  # DVC reads a relative url from the directory of the config file
        path = REPO / ".dvc" / path
    path = path.resolve()
    assert not path.is_relative_to(REPO.resolve()), f"remote {name!r} at {path} is inside the workspace"
    assert url.startswith("~"), f"remote {name!r}: {url}: per user, the same for every clone on the machine"
    gitignore = (REPO / ".dvc" / ".gitignore").read_text().split()
    assert "/config.local" in gitignore  # where `dvc remote modify --local` puts a user's own url


def test_every_uncached_output_of_the_pipeline_is_left_to_git():
    """``dvc pull`` restores the cached outputs; the ``cache: false`` ones (metrics, plots, reports,
    data/raw/stats.json) reach a fresh clone only through git, so none may be git-ignored."""
    uncached = [path for stage in read_stages(REPO / "dvc.yaml").values() for path in stage.uncached]
    assert "data/raw/stats.json" in uncached and "reports" in uncached
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *uncached], cwd=REPO, capture_output=True, text=True)
    assert ignored.stdout.split() == [], f"git-ignored, so a fresh clone cannot get them: {ignored.stdout.split()}"
    # and committed: a fresh clone without them sees the stage changed (`dvc status`: deleted) and re-runs it
    untracked = [p for p in uncached
                 if not subprocess.run(["git", "ls-files", "--", p], cwd=REPO, capture_output=True, text=True).stdout]
    assert untracked == [], f"not committed, so a fresh clone re-runs their stages: {untracked}"


@pytest.mark.slow
def test_push_fills_the_default_remote_under_home(pushed):
    root, _env_, push = pushed
    _name, url = _shipped_remote()
    store = root / "home" / url.removeprefix("~/")
    files = [p for p in store.rglob("*") if p.is_file()]
    assert len(files) == 2, (push, files)  # raw.txt and total.json, one object each
    assert "2 files pushed" in push, push


@pytest.mark.slow
def test_fresh_clone_pull_restores_every_output_and_repro_runs_nothing(pushed):
    root, env, _push = pushed
    _run(root, env, "git", "clone", "-q", "a", "b")
    b = root / "b"
    assert not (b / "raw.txt").exists() and not (b / "total.json").exists()
    _run(b, env, "dvc", "pull")
    assert (b / "raw.txt").read_text() == "1 2 3\n1 2 3\n"
    assert (b / "total.json").read_text() == '{"total": 12}'
    status = _run(b, env, "dvc", "status")
    assert "Data and pipelines are up to date." in status.stdout, status.stdout
    repro = _run(b, env, "dvc", "repro")
    assert "Running stage" not in repro.stdout and "up to date" in repro.stdout, repro.stdout
    assert _runs(root, "b") == []  # no stage command ran in b


@pytest.mark.slow
def test_fresh_clone_without_pull_would_run_every_stage(pushed):
    root, env, _push = pushed
    _run(root, env, "git", "clone", "-q", "a", "c")
    c = root / "c"
    repro = _run(c, env, "dvc", "repro")
    assert repro.stdout.count("Running stage") == 2, repro.stdout
    assert _runs(root, "c") == ["raw", "total"]


@pytest.mark.slow
def test_a_local_url_overrides_the_shipped_one_and_stays_out_of_git(pushed, tmp_path):
    root, env, _push = pushed
    _run(root, env, "git", "clone", "-q", "a", "d")
    d = root / "d"
    name, _url = _shipped_remote()
    elsewhere = tmp_path / "elsewhere"
    _run(d, env, "dvc", "remote", "modify", "--local", name, "url", str(elsewhere))
    assert _run(d, env, "git", "status", "--porcelain").stdout == ""  # .dvc/config.local is git-ignored
    pull = _run(d, env, "dvc", "pull", check=False)  # the empty directory, not the shipped remote
    assert pull.returncode != 0 and "Missing cache files" in pull.stderr, (pull.stdout, pull.stderr)
    assert not (d / "raw.txt").exists()
    a2 = root / "a2"  # a copy of a, cache included, whose user pushes to their own directory
    shutil.copytree(root / "a", a2)
    _run(a2, env, "dvc", "remote", "modify", "--local", name, "url", str(elsewhere))
    assert "2 files pushed" in _run(a2, env, "dvc", "push").stdout
    _run(d, env, "dvc", "pull")
    assert (d / "total.json").read_text() == '{"total": 12}'
    assert _runs(root, "d") == []
