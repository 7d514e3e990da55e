"""The whole DAG through real DVC and the Prefect flow, on a tiny model in a temporary git repo.

One module-scoped workspace: `dvc repro` runs every stage; a second `dvc repro` runs nothing;
`dvc exp run -S train.seed=1` re-runs only check_params (the guard), train, final_eval and report and `dvc exp show` lists
the experiment (the seed, not the lr: on a tiny model every group can tie, so a new lr may leave the
adapter byte-identical and DVC rightly skips final_eval; a new seed always draws new LoRA weights);
the Prefect flow then skips every cached stage (the flow beside a running DVC: tests/test_flow_workspace.py).
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from grpo.core.dvcfile import read_stages
from tests.conftest import make_dvc_workspace
from tests.helpers import TINY_PARAMS, workspace_md5

pytestmark = pytest.mark.slow


def _env(**extra):
    env = {**os.environ, "WANDB_MODE": "disabled", "DVC_NO_ANALYTICS": "1", "PYTHONPATH": "", **extra}
    env["PATH"] = f"{Path(sys.executable).parent}:{env['PATH']}"  # `python` in dvc.yaml is this venv's
    return env


def _sh(cwd, *cmd, check=True, env=None):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env or _env(), timeout=900)
    if check and proc.returncode != 0:
        raise AssertionError(f"{cmd} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _ran(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage '")}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_model_dir):
    params = json.loads(json.dumps(TINY_PARAMS))
    params["model"]["name"] = str(tiny_model_dir)
    return make_dvc_workspace(tmp_path_factory.mktemp("ws"), params)


def test_dvc_repro_runs_the_whole_dag(workspace):
    reads_log = workspace.parent / "params_read.jsonl"
    out = _sh(workspace, sys.executable, "-m", "dvc", "repro", env=_env(GRPO_PARAMS_READ_LOG=str(reads_log))).stdout
    assert _ran(out) == set(read_stages(workspace / "dvc.yaml"))  # every stage
    sorted_rows = [json.loads(x) for x in (workspace / "data/cache/train_sorted.jsonl").read_text().splitlines()]
    assert [r["semantic_entropy"] for r in sorted_rows] == sorted(r["semantic_entropy"] for r in sorted_rows)
    for name in ("baseline", "final"):
        m = json.loads((workspace / "metrics" / f"{name}.json").read_text())
        assert m["n"] == len((workspace / "data/raw/test.jsonl").read_text().splitlines())
        assert 0 <= m["accuracy_ci95_low"] <= m["accuracy"] <= m["accuracy_ci95_high"] <= 1
    assert "LoRA merged" in json.loads((workspace / "metrics/final.json").read_text())["weights"]
    assert (workspace / "models/adapter/adapter_config.json").exists()
    report = (workspace / "reports/report.md").read_text()
    assert "## Result" in report and "curves.png" in report and (workspace / "reports/report.html").exists()
    for png in ("accuracy.png", "curves.png", "signals.png", "sent_entropy.png"):
        assert (workspace / "reports" / png).stat().st_size > 1000
    # every params field a stage read is declared in its `params:` (else DVC misses the change)
    stages = read_stages(workspace / "dvc.yaml")
    timed = {name for name, stage in stages.items() if not stage.guard}  # a guard (check_params) writes its stamp alone
    reads = [json.loads(line) for line in reads_log.read_text().splitlines()]
    assert {r["stage"] for r in reads} == timed
    for r in reads:
        declared = stages[r["stage"]].params
        if stages[r["stage"]].all_params:  # the whole file
            continue
        undeclared = [k for k in r["params"] if k not in declared and k.split(".")[0] not in declared]
        assert not undeclared, f"{r['stage']} reads {undeclared} but dvc.yaml does not declare them"
    for stage in timed:
        assert json.loads((workspace / "metrics" / "time" / f"{stage}.json").read_text())["seconds"] > 0


def test_second_repro_runs_nothing(workspace):
    out = _sh(workspace, sys.executable, "-m", "dvc", "repro").stdout
    assert _ran(out) == set()
    _sh(workspace, "git", "add", "-A")
    _sh(workspace, "git", "commit", "-qm", "baseline run")


REPO = Path(__file__).resolve().parents[1]
ACTIVATE = "source .venv/bin/activate"


def readme_shell_commands() -> list[str]:
    """The commands of the README's fresh-shell block (the fenced block that opens with the
    activation), comments dropped, the activation first."""
    import re

    for block in re.findall(r"```bash\n(.*?)```", (REPO / "README.md").read_text(), re.S):
        lines = [line.split("  #")[0].strip() for line in block.splitlines() if line.strip()]
        if lines and lines[0] == ACTIVATE:
            return lines
    raise AssertionError("README.md has no ```bash block that opens with " + ACTIVATE)


def pipeline_next_commands() -> list[str]:
    """The commands scripts/pipeline.sh's last lines tell a user to run next (its indented echo lines)."""
    import re

    return [m.split("  #")[0].strip() for m in re.findall(r'^echo "  (.*)"$', (REPO / "scripts/pipeline.sh").read_text(), re.M)]


def fresh_shell(cwd: Path, script: str) -> subprocess.CompletedProcess:
    """``script`` in a new login-less bash with a system PATH only (no venv on it), as a new terminal runs it."""
    env = {"HOME": os.environ.get("HOME", "/tmp"), "PATH": "/usr/local/bin:/usr/bin:/bin", "WANDB_MODE": "disabled",
           "DVC_NO_ANALYTICS": "1", "LANG": "C.UTF-8"}
    return subprocess.run(["bash", "--noprofile", "--norc", "-c", script], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=600)


def test_the_readme_and_pipeline_follow_up_commands_run_in_a_fresh_shell(workspace):
    """Every follow-up command the README's fresh-shell block and pipeline.sh's last lines name runs,
    exactly as written, in a new shell whose PATH has no venv, in a workspace that has run; without the
    activation the same commands are not found (so the activation the docs say is what makes them run)."""
    venv = workspace / ".venv"
    venv.symlink_to(sys.prefix)  # the workspace's .venv is this suite's environment, as setup makes it in a clone
    try:
        readme, after = readme_shell_commands(), pipeline_next_commands()
        assert after[0] == ACTIVATE and len(readme) > 1 and len(after) > 1
        for command in dict.fromkeys(readme[1:] + after[1:]):
            proc = fresh_shell(workspace, f"{ACTIVATE} && {command}")
            assert proc.returncode == 0, (f"{command!r} in a fresh shell: rc {proc.returncode}\n{proc.stdout[-1500:]}\n"
                                          f"{proc.stderr[-1500:]}")
        bare = fresh_shell(workspace, readme[1])
        assert bare.returncode != 0, f"{readme[1]!r} ran without the activation: the test's PATH is not a fresh shell's"
    finally:
        venv.unlink()  # the workspace as the later tests expect it


@pytest.mark.parametrize("value", ["train.steps=forty", "train.nonexistent=1"])
def test_a_refused_experiment_changes_nothing(workspace, value):
    """After the committed run: a bad value through `dvc exp run -S` is refused before any stage's
    outputs are removed (check_params, or DVC itself for a key params.yaml lacks): every file (the
    adapter, dvclive's files, the times) and `dvc status` as before."""
    before, status = workspace_md5(workspace), _sh(workspace, sys.executable, "-m", "dvc", "status", "--json").stdout
    proc = _sh(workspace, sys.executable, "-m", "dvc", "exp", "run", "-S", value, check=False)
    assert proc.returncode != 0 and value.split("=")[0] in proc.stdout + proc.stderr, proc.stderr[-2000:]
    assert workspace_md5(workspace) == before
    assert _sh(workspace, sys.executable, "-m", "dvc", "status", "--json").stdout == status


def test_experiment_reruns_only_train_and_after(workspace):
    out = _sh(workspace, sys.executable, "-m", "dvc", "exp", "run", "-n", "seed-1", "-S", "train.seed=1").stdout
    guards = {name for name, stage in read_stages(workspace / "dvc.yaml").items() if stage.guard}
    assert _ran(out) == {"train", "final_eval", "report"} | guards  # the guard's stamp unchanged: nothing more
    shown = json.loads(_sh(workspace, sys.executable, "-m", "dvc", "exp", "show", "--json").stdout)
    assert "seed-1" in json.dumps(shown)
    table = _sh(workspace, sys.executable, "-m", "dvc", "exp", "show", "--no-pager", "--md").stdout
    assert "seed-1" in table and "accuracy" in table


def test_prefect_flow_skips_cached_stages(workspace):
    _sh(workspace, "git", "checkout", "-q", "--", ".")  # back to the committed run: params, dvc.lock, metrics
    _sh(workspace, sys.executable, "-m", "dvc", "checkout", "-q", check=False)
    proc = _sh(workspace, sys.executable, "-m", "flows.pipeline", "--workdir", str(workspace))
    stages = set(read_stages(workspace / "dvc.yaml"))
    statuses = dict(line.split()[:2] for line in proc.stdout.splitlines() if line.split()[:1] and line.split()[0] in
                    stages)
    assert set(statuses) == stages and set(statuses.values()) == {"skipped"}, proc.stdout[-2000:]


def test_unknown_params_key_is_one_clear_line(workspace, tmp_path):
    bad = tmp_path / "params.yaml"
    bad.write_text("train:\n  learning_rate: 0.1\n")
    proc = _sh(workspace, sys.executable, "-m", "tasks.train", "--params", str(bad), check=False)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("train: error: train.learning_rate: unknown key")


def test_ctrl_c_in_a_repro_of_train_keeps_the_shipped_adapter_and_final_eval_runs(workspace):
    """After the committed run: a longer run of train through `dvc repro`, Ctrl-C (SIGINT to the
    process group, as a terminal sends it) once its first step is logged. The shipped adapter is
    the committed run's byte for byte (DVC leaves a persist output in place; the stage swaps a new
    adapter in only when a run completes), and final_eval runs on it."""
    import hashlib
    import shutil
    import signal
    import time

    import yaml

    _sh(workspace, "git", "checkout", "-q", "--", ".")
    _sh(workspace, sys.executable, "-m", "dvc", "checkout", "-q", check=False)
    params = yaml.safe_load((workspace / "params.yaml").read_text())
    adapter, out_dir = workspace / params["train"]["adapter_dir"], workspace / params["train"]["output_dir"]
    digest = lambda: {p.name: hashlib.md5(p.read_bytes()).hexdigest() for p in adapter.iterdir()}  # noqa: E731
    before = digest()
    params["train"]["steps"] = 500
    (workspace / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    shutil.rmtree(out_dir)  # scratch space: the step log below is then the new run's
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro", "train"], cwd=workspace, env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    log, deadline = out_dir / "steps.jsonl", time.time() + 300
    while not (log.exists() and log.read_text().strip()) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert proc.poll() is None, proc.communicate()[0][-3000:]
    os.killpg(proc.pid, signal.SIGINT)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode != 0, out[-3000:]  # DVC dies of the signal too (its own output may be lost with it)
    assert digest() == before
    _sh(workspace, "git", "checkout", "-q", "--", "params.yaml")
    _sh(workspace, sys.executable, "-m", "tasks.final_eval")
