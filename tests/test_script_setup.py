"""The set-up scripts on a machine that has only a public index (issue 38).

``scripts/install_torch.sh`` runs in a fresh virtual environment with this workplace's pip sources
switched off (``PIP_CONFIG_FILE=/dev/null``, no ``PIP_FIND_LINKS``). Two local ``file://`` simple
indexes (PEP 503 layout) stand in for the internet: an empty one for the public index, which lacks
``+cpu`` builds, and one listing the machine's local ``torch-X+cpu`` wheel for PyTorch's CPU index
(``TORCH_CPU_INDEX``). The fallback must install that build from the stand-in; without it, the script
must stop with one line naming the index and the variable. The other tests check the one-line refusals
of setup.sh (an interpreter without its venv module, or of an unsupported version) and of
pipeline.sh (no git), and that setup's project install (uv, which reads no pip configuration) is
handed the sources pip is configured with.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
import tomllib
import venv
from pathlib import Path
from urllib.parse import quote

import pytest

from .conftest import REPO

PIN = next(d.split("==", 1)[1] for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
           if d.startswith("torch=="))
CPU_BUILD = f"{PIN}+cpu"


def _local_cpu_wheel() -> Path | None:
    """The local ``torch-X+cpu`` wheel for this interpreter in a PIP_FIND_LINKS folder, if any."""
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    for folder in os.environ.get("PIP_FIND_LINKS", "").split():
        found = sorted(Path(folder).glob(f"torch-{CPU_BUILD}-{tag}-{tag}-*.whl"))
        if found:
            return found[0]
    return None


def _simple_index(root: Path, wheel: Path | None) -> str:
    """A PEP 503 simple index at ``root``: ``torch/index.html`` links ``wheel`` (none: no torch)."""
    (root / "torch").mkdir(parents=True)
    link = "" if wheel is None else f'<a href="file://{quote(str(wheel))}">{wheel.name}</a>'
    (root / "torch" / "index.html").write_text(f"<!DOCTYPE html><html><body>{link}</body></html>\n")
    return root.as_uri()


def _public_only_env(public_index: str, cpu_index: str) -> dict[str, str]:
    """This process's environment without the workplace's pip sources: ``public_index`` as the only
    index, ``cpu_index`` as TORCH_CPU_INDEX."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE="/dev/null", PIP_INDEX_URL=public_index, PIP_DISABLE_PIP_VERSION_CHECK="1",
               TORCH_CPU_INDEX=cpu_index)
    return env


def _installed_torch(python: Path) -> str:
    code = "import importlib.metadata as m\ntry: print(m.version('torch'))\nexcept m.PackageNotFoundError: print('')"
    return subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=True).stdout.strip()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="the CPU build is chosen on machines without a GPU")
def test_torch_step_takes_the_cpu_build_from_the_cpu_index_else_stops_in_one_line(tmp_path):
    wheel = _local_cpu_wheel()
    if wheel is None:
        pytest.skip(f"no local torch-{CPU_BUILD} wheel for this Python in PIP_FIND_LINKS")
    public = _simple_index(tmp_path / "public", None)
    python = tmp_path / "venv" / "bin" / "python"
    venv.create(tmp_path / "venv", with_pip=True)

    # no source offers the CPU build: one line, no resolver output, nothing installed
    missing = _simple_index(tmp_path / "no-cpu-builds", None)
    proc = subprocess.run(["bash", "scripts/install_torch.sh", str(python)], cwd=REPO, capture_output=True, text=True,
                          env=_public_only_env(public, missing), timeout=300)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 1, out
    assert len(out.splitlines()) == 1, out
    assert f"TORCH_CPU_INDEX={missing}" in out and f"torch=={CPU_BUILD}" in out, out
    assert "Traceback" not in out and "ResolutionImpossible" not in out
    assert _installed_torch(python) == ""

    # the stand-in for PyTorch's CPU index offers it: installed from there
    cpu = _simple_index(tmp_path / "cpu", wheel)
    proc = subprocess.run(["bash", "scripts/install_torch.sh", str(python)], cwd=REPO, capture_output=True, text=True,
                          env=_public_only_env(public, cpu), timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"torch: {CPU_BUILD} from {cpu}"
    assert _installed_torch(python) == CPU_BUILD

    # a second run does nothing
    proc = subprocess.run(["bash", "scripts/install_torch.sh", str(python)], cwd=REPO, capture_output=True, text=True,
                          env=_public_only_env(public, missing), timeout=300)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"torch: {CPU_BUILD} already installed")


@pytest.mark.slow
def test_an_older_drivers_torch_comes_from_torch_cuda_index(tmp_path):
    """On a machine with nvidia-smi, TORCH_CUDA_INDEX replaces the registry's CUDA 13 build: torch==X
    from that index (here a stand-in index holding the local X+cpu wheel, as PyTorch's cu126 index
    holds X+cu126), and a second run keeps it instead of reinstalling the registry's build."""
    wheel = _local_cpu_wheel()
    if wheel is None:
        pytest.skip(f"no local torch-{CPU_BUILD} wheel for this Python in PIP_FIND_LINKS")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "nvidia-smi").write_text("#!/bin/sh\nexit 0\n")
    (bin_dir / "nvidia-smi").chmod(0o755)
    python = tmp_path / "venv" / "bin" / "python"
    venv.create(tmp_path / "venv", with_pip=True)
    older = _simple_index(tmp_path / "cu-older", wheel)
    env = {**_public_only_env(_simple_index(tmp_path / "public", None), older), "TORCH_CUDA_INDEX": older,
           "PATH": f"{bin_dir}:{os.environ['PATH']}"}
    proc = subprocess.run(["bash", "scripts/install_torch.sh", str(python)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.strip() == f"torch: {CPU_BUILD} from {older}"
    proc = subprocess.run(["bash", "scripts/install_torch.sh", str(python)], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=300)
    assert (proc.returncode, proc.stdout.strip()) == (0, f"torch: {CPU_BUILD} already installed")


def _fake_python(path: Path, version_ok: bool, has_ensurepip: bool) -> Path:
    """An executable that answers setup.sh's two probes: the version check and ``import ensurepip``."""
    path.write_text("#!/bin/sh\n"
                    'case "$*" in\n'
                    f"  *ensurepip*) exit {0 if has_ensurepip else 1} ;;\n"
                    f"  *version_info*) exit {0 if version_ok else 1} ;;\n"
                    "esac\n"
                    "exit 3\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


def _copy_of_setup(root: Path) -> Path:
    """setup.sh in an empty project folder (no .venv), so that it reaches its checks."""
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup.sh", root / "scripts" / "setup.sh")
    return root / "scripts" / "setup.sh"


@pytest.mark.parametrize("version_ok, expected", [
    (True, "setup: error: {py} has no venv module; install it (Debian/Ubuntu: apt-get install python3.12-venv)"),
    (False, "setup: error: PYTHON={py} is not Python 3.11, 3.12 or 3.13; install one"),
])
def test_setup_names_the_missing_python_piece_in_one_line(tmp_path, version_ok, expected):
    (tmp_path / "bin").mkdir()
    py = _fake_python(tmp_path / "bin" / "python3.12", version_ok, has_ensurepip=False)
    script = _copy_of_setup(tmp_path / "project")
    env = {**os.environ, "PYTHON": str(py)}
    proc = subprocess.run(["bash", str(script)], capture_output=True, text=True, env=env, timeout=60)
    out = (proc.stdout + proc.stderr).strip()
    assert proc.returncode == 1, out
    assert len(out.splitlines()) == 1, out
    assert out.startswith(expected.format(py=py)), out
    assert not (tmp_path / "project" / ".venv").exists()


def test_pipeline_without_git_names_git_in_one_line(tmp_path):
    bin_dir = tmp_path / "bin"  # PATH holds only what the script needs before its check
    bin_dir.mkdir()
    for tool in ("bash", "dirname"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    proc = subprocess.run([str(bin_dir / "bash"), "scripts/pipeline.sh"], cwd=REPO, capture_output=True, text=True,
                          env={"PATH": str(bin_dir), "HOME": str(tmp_path)}, timeout=60)
    out = (proc.stdout + proc.stderr).strip()
    assert (proc.returncode, out) == (1, "pipeline: error: git is not installed; install it "
                                         "(Debian/Ubuntu: apt-get install git)")


def _pip_sources(env: dict[str, str]) -> list[str]:
    """The lines scripts/pip_sources.py prints (setup.sh passes each as one argument to uv)."""
    proc = subprocess.run([sys.executable, "scripts/pip_sources.py"], cwd=REPO, capture_output=True, text=True,
                          env=env, timeout=60, check=True)
    return proc.stdout.splitlines()


def test_uv_gets_the_sources_pip_is_configured_with(tmp_path):
    """setup.sh's project install (uv) sees pip's sources: PIP_* over the config file's ``install``
    section over ``global``; nothing configured: no flag (PyPI, for both)."""
    conf = tmp_path / "pip.conf"
    conf.write_text("[global]\nindex-url = https://mirror.example/simple\nfind-links = /wheels\n"
                    "[install]\nextra-index-url = https://a.example/simple https://b.example/simple\n")
    bare = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    assert _pip_sources({**bare, "PIP_CONFIG_FILE": "/dev/null"}) == []
    assert _pip_sources({**bare, "PIP_CONFIG_FILE": str(conf)}) == [
        "--index-url", "https://mirror.example/simple",
        "--extra-index-url", "https://a.example/simple", "--extra-index-url", "https://b.example/simple",
        "--find-links", "/wheels"]
    env = {**bare, "PIP_CONFIG_FILE": str(conf), "PIP_INDEX_URL": "file:///local/simple"}
    assert _pip_sources(env)[:2] == ["--index-url", "file:///local/simple"]


def _stand_in_project(root: Path) -> Path:
    """setup.sh, pip_sources.py and pyproject.toml in a project folder whose .venv holds stand-in
    installers: python, uv and install_torch.sh append what they were asked to ``calls.log``
    (the installs themselves are not under test here, only whether setup starts them)."""
    (root / "scripts").mkdir(parents=True)
    for name in ("setup.sh", "pip_sources.py"):
        shutil.copy(REPO / "scripts" / name, root / "scripts" / name)
    shutil.copy(REPO / "pyproject.toml", root / "pyproject.toml")
    log = root / "calls.log"
    (root / "scripts" / "install_torch.sh").write_text(f'echo torch >> "{log}"\n')
    (root / ".venv" / "bin").mkdir(parents=True)
    stand_ins = {
        "python": "#!/bin/sh\n"
                  f'case "$1 $2" in "-m pip") echo "pip $3" >> "{log}"; exit 0 ;; esac\n'
                  'case "$1" in scripts/pip_sources.py) exit 0 ;; -) cat >/dev/null; exit 0 ;; esac\n'
                  "exit 3\n",
        "uv": f'#!/bin/sh\necho "uv $2" >> "{log}"\n',
    }
    for name, text in stand_ins.items():
        (root / ".venv" / "bin" / name).write_text(text)
        (root / ".venv" / "bin" / name).chmod(0o755)
    return log


def test_a_second_setup_with_nothing_changed_installs_nothing(tmp_path):
    """The stamp: a finished setup records what it installed from; the next run with the same files,
    extras, sources and knobs says so in one line and starts no installer; a changed pyproject.toml,
    another extra or GRPO_SETUP_FORCE=1 installs again."""
    root = tmp_path / "project"
    log = _stand_in_project(root)

    def setup(*extras: str, **env: str) -> tuple[str, list[str]]:
        before = log.read_text().splitlines() if log.exists() else []
        proc = subprocess.run(["bash", "scripts/setup.sh", *extras], cwd=root, capture_output=True, text=True,
                              env={**os.environ, **env}, timeout=60)
        assert proc.returncode == 0, proc.stderr
        installs = [c for c in log.read_text().splitlines()[len(before):] if c != "pip --version"]
        return proc.stdout.strip(), installs

    assert setup()[1][:3] == ["pip install", "torch", "uv install"]  # then uv uninstall where no nvidia-smi
    out, installs = setup()
    assert installs == [] and out.startswith("setup: up to date (.venv was set up from these files, extras [dev,")
    assert setup("deepspeed")[1] != [] and setup("deepspeed")[1] == []
    assert setup("deepspeed", GRPO_SETUP_FORCE="1")[1] != []
    (root / "pyproject.toml").write_text((root / "pyproject.toml").read_text() + "\n# an edit\n")
    assert setup("deepspeed")[1] != []
