"""The train stage (``python -m tasks.train``) end to end on a tiny random model: adapter and metrics
outputs, resume after kill -9, wandb offline logging, and one line for a bad param."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from .conftest import REPO
from .helpers import DETERMINISTIC, _steps, _train, _write_params


@pytest.mark.slow
def test_stage_outputs_and_resume_after_kill_9(tiny_model_dir, tiny_problems, tmp_path):
    """kill -9 after the second checkpoint; the restart continues from it and matches an
    uninterrupted run step for step."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    full_dir, crash_dir = tmp_path / "full", tmp_path / "crash"
    full_dir.mkdir()
    crash_dir.mkdir()
    proc = _train(_write_params(full_dir, tiny_model_dir, tiny_problems))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    uninterrupted = _steps(full_dir)
    assert [r["step"] for r in uninterrupted] == list(range(1, 9))

    # outputs of a complete run: a PEFT adapter that PeftModel loads, and the summary metrics
    adapter = full_dir / "adapter"
    assert (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    PeftModel.from_pretrained(base, adapter)
    summary = json.loads((full_dir / "metrics" / "train.json").read_text())
    assert summary["steps"] == 8
    assert (full_dir / "metrics" / "train" / "metrics.json").exists()  # dvclive

    crash_params = _write_params(crash_dir, tiny_model_dir, tiny_problems)
    proc = _train(crash_params)
    second = crash_dir / "out" / "checkpoints" / "step_000004"
    deadline = time.time() + 300
    while not second.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert second.exists(), "second checkpoint never appeared"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert not (crash_dir / "adapter").exists() and not (crash_dir / "metrics" / "train.json").exists()
    resumed_from = max(int(p.name.split("_")[1]) for p in (crash_dir / "out" / "checkpoints").glob("step_*"))

    proc = _train(crash_params)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "resumed from" in out and f"step {resumed_from})" in out
    resumed = _steps(crash_dir)
    assert [r["step"] for r in resumed] == list(range(1, 9))  # none repeated, none skipped
    for a, b in zip(uninterrupted, resumed):
        assert {k: a[k] for k in DETERMINISTIC} == pytest.approx({k: b[k] for k in DETERMINISTIC}, rel=1e-5, abs=1e-6)


@pytest.mark.slow
def test_stage_logs_to_wandb_offline(tiny_model_dir, tiny_problems, tmp_path):
    params = _write_params(tmp_path, tiny_model_dir, tiny_problems, steps=1, checkpoints={"every": 0}, wandb={"mode": "offline"})
    env = {**os.environ, "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.train", "--params", str(params)], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))


def test_cli_bad_param_exits_nonzero_with_one_line_and_writes_nothing(tmp_path):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"]["optimizer"]["lr"] = -0.1
    params["train"].update(
        output_dir=str(tmp_path / "out"), adapter_dir=str(tmp_path / "adapter"), metrics_dir=str(tmp_path / "m")
    )
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.train", "--params", str(path)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["train: error: train.optimizer.lr: must be > 0, got -0.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


@pytest.mark.parametrize(("text", "message"), [
    ("steps: 5\n  lr: 0.001\n  steps: 7\n", "4: duplicate key 'steps' (first at line 2); a mapping takes each key once"),
    ("steps: 5\n lr: [0.001\n", "3: not valid YAML (while parsing a block mapping: expected <block end>, but "
                                "found '<block mapping start>', column 2)"),
])
def test_a_repeated_key_or_bad_yaml_in_the_params_exits_2_with_one_line(text, message, tmp_path):
    """The stage reads its params with the same reader as ``grpo check``: one line, exit 2, nothing written."""
    path = tmp_path / "params.yaml"
    path.write_text(f"train:\n  {text}")
    proc = subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(path)], cwd=REPO,
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert [line for line in proc.stderr.splitlines() if line.strip()] == [f"train: error: {path}:{message}"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


def _files(folder) -> dict:
    """``{relative path: bytes}`` of every file under ``folder``."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.slow
def test_ctrl_c_keeps_the_shipped_adapter_and_summary(tiny_model_dir, tiny_problems, tmp_path):
    """A completed run ships an adapter and a summary; a second run interrupted by Ctrl-C (SIGINT)
    mid-training leaves both byte for byte, and says so in one line naming the checkpoint to resume from."""
    proc = _train(_write_params(tmp_path, tiny_model_dir, tiny_problems, steps=2))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    adapter, summary = _files(tmp_path / "adapter"), (tmp_path / "metrics" / "train.json").read_bytes()

    proc = _train(_write_params(tmp_path, tiny_model_dir, tiny_problems, steps=500))
    second = tmp_path / "out" / "checkpoints" / "step_000004"
    deadline = time.time() + 300
    while not second.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert second.exists(), "the second run's checkpoint never appeared"
    proc.send_signal(signal.SIGINT)
    err, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, err[-3000:]
    ckpt = max((tmp_path / "out" / "checkpoints").glob("step_*"))
    assert err.splitlines()[-1] == (
        f"train: interrupted; {tmp_path / 'adapter'} and {tmp_path / 'metrics' / 'train.json'} are unchanged (the "
        f"last completed run's, if any); rerun to resume from {ckpt}")
    assert _files(tmp_path / "adapter") == adapter
    assert (tmp_path / "metrics" / "train.json").read_bytes() == summary


@pytest.mark.slow
def test_a_changed_setting_moves_the_earlier_run_aside(tiny_model_dir, tiny_problems, tmp_path):
    """A run, then ``train.steps`` changed and a second run: it starts afresh, and the first run's
    checkpoints and step log are where its one warning line says, unchanged."""
    proc = _train(_write_params(tmp_path, tiny_model_dir, tiny_problems, steps=2, checkpoints={"every": 1}))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    first = _files(tmp_path / "out")

    proc = _train(_write_params(tmp_path, tiny_model_dir, tiny_problems, steps=3, checkpoints={"every": 1}))
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    warnings = [line for line in out.splitlines() if "params or data changed" in line]
    assert len(warnings) == 1, out
    moved = next((tmp_path / "out.previous").iterdir())
    assert warnings[0] == (
        f"[train] WARNING params or data changed since the run in {tmp_path / 'out'}: starting afresh; the earlier "
        f"run is now {moved} (to continue it, put back its params and data and that folder in place of "
        f"{tmp_path / 'out'})")
    assert _files(moved) == first and "checkpoints/step_000002/adapter.safetensors" in first
    assert [r["step"] for r in _steps(tmp_path)] == [1, 2, 3]


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_an_empty_validation_file_stops_the_stage_before_the_model_loads(tiny_problems, tmp_path):
    """eval_every with a validation file of no row: one line naming the key, exit 2, no model read
    (the model path does not exist)."""
    (tmp_path / "val.jsonl").write_text("")
    params = _write_params(tmp_path, tmp_path / "no_model", tiny_problems,
                           checkpoints={"val_path": str(tmp_path / "val.jsonl"), "eval_every": 4})
    proc = _train(params)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 2, out
    assert out.strip().splitlines()[-1].startswith("train: error: train.checkpoints.eval_every: 4 evaluates "
                                                   f"{tmp_path}/val.jsonl every 4 steps, but it holds no row (the file)")
    assert not (tmp_path / "out").exists()
