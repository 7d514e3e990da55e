"""The ``grpo`` command: how it finds the workspace under a preset, its one-line refusals of bad
params and options, before torch loads (``check``'s report: tests/test_check_report.py; ``ask``:
tests/test_ask.py; the estimate's exact parts: tests/test_memory.py)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from grpo.tools import cli

from .conftest import REPO
from .helpers import run

pytestmark = pytest.mark.usefixtures("quiet_cli_env")


def test_unknown_key_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"train": {"learning_rate": 0.1}}))
    proc = subprocess.run([sys.executable, "-m", "grpo.tools.cli", "check", "--params", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"grpo check: error: {path}: train.learning_rate: unknown key; did you mean train.optimizer.lr?"]


def test_the_help_imports_no_torch_and_a_bad_file_no_report(tmp_path):
    """``grpo check --help`` imports nothing of torch (``python -X importtime``'s log); a bad params file
    is refused in one line before the report's half (``grpo.tools.check_report``) is imported."""
    def imported(*argv: str) -> tuple[int, list[str], list[str]]:
        proc = subprocess.run([sys.executable, "-X", "importtime", "-m", "grpo.tools.cli", *argv], cwd=REPO,
                              capture_output=True, text=True, timeout=120)
        log = proc.stderr.splitlines()
        return (proc.returncode, [x.split("|")[-1].strip() for x in log if x.startswith("import time:")],
                [x for x in log if not x.startswith("import time:") and x.strip()])

    code, modules, _ = imported("check", "--help")
    assert code == 0 and "grpo.rollout.engine.preflight" in modules
    assert [m for m in modules if m.split(".")[0] == "torch" or m.startswith("grpo.tools.check_report")] == []
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"train": {"steps": 0}}))
    code, modules, lines = imported("check", "--params", str(path))
    assert code == 2 and "grpo.config.params" in modules and "grpo.tools.check_report" not in modules
    assert lines == [f"grpo check: error: {path}: train.steps: must be > 0, got 0"]


def test_a_preset_is_put_over_the_workspace_params(tmp_path):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"train": {"steps": 7, "optimizer": {"lr": 1.0e-3}}}))
    (tmp_path / "presets").mkdir()
    preset = tmp_path / "presets" / "p.yaml"
    preset.write_text(yaml.safe_dump({"train": {"optimizer": {"lr": 2.0e-4}}}))
    res = cli.resolve_params(preset)
    assert res.root == tmp_path
    assert (res.params.train.steps, res.params.train.optimizer.lr) == (7, 2.0e-4)
    assert res.changed == ["train.optimizer.lr"]
    assert cli.resolve_params(tmp_path / "params.yaml").changed == []
    from grpo.tools.dvcstatus import describe

    assert describe(tmp_path) == [f"dvc: {tmp_path} is not a DVC workspace (it needs a .dvc folder and a dvc.yaml): "
                                  "no stage status"]


def test_a_card_size_that_is_not_positive_is_one_line(capsys):
    code, out, err = run(capsys, "check", "--params", str(REPO / "params.yaml"), "--gpu-memory", "0")
    assert (code, out, err.strip()) == (2, "", "grpo check: error: --gpu-memory: must be > 0 GiB")


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_check_on_a_cuda_build_without_a_usable_gpu_is_one_line(monkeypatch, capsys):
    """The device line says why, and the estimate for this machine stops with the one-line error
    (``--device cuda`` still estimates for a card this machine does not have)."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("GRPO_DEVICE", raising=False)
    code, out, err = run(capsys, "check", "--params", str(REPO / "params.yaml"), "--prompt-tokens", "100")
    assert code == 2 and "device: estimating for this machine: none usable: torch " in out
    (line,) = err.strip().splitlines()
    assert line.startswith("grpo check: error: torch ") and line.endswith("set GRPO_DEVICE=cpu")
    code, out, _ = run(capsys, "check", "--params", str(REPO / "params.yaml"), "--prompt-tokens", "100",
                       "--device", "cuda")
    assert code == 0 and "memory: one training step on cuda" in out
    assert "device: estimating for cuda (--device); this machine: none usable: torch " in out


def test_version_is_the_packages(capsys):
    from importlib.metadata import version

    with pytest.raises(SystemExit) as done:
        cli.main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out == f"grpo {version('grpo')}\n"
    assert cli.package_version() == version("grpo")


@pytest.mark.parametrize(("raw", "message"), [
    ({"train": {"optimizer": {"lr": "fast"}}}, "train.optimizer.lr: must be a number, got 'fast'"),
    ({"train": {"optimizer": {"lr": "5e-4"}}}, "train.optimizer.lr: must be a number, got '5e-4' (YAML reads 5e-4 as text: write 5.0e-4)"),
    ({"lora": {"lora_alpha": 16}}, "lora.lora_alpha: unknown key; did you mean lora.alpha?"),
])
def test_a_bad_params_file_is_one_line_naming_the_field(raw, message, tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    code, out, err = run(capsys, "check", "--params", str(path))
    assert (code, out, err) == (2, "", f"grpo check: error: {path}: {message}\n")


@pytest.mark.parametrize(("text", "message"), [
    ("train:\n  steps: 5\n  lr: 0.001\n  steps: 7\n", "4: duplicate key 'steps' (first at line 2); a mapping takes "
                                                     "each key once"),
    ("train:\n  steps: 5\n lr: [0.001\n", "3: not valid YAML (while parsing a block mapping: expected <block end>, "
                                           "but found '<block mapping start>', column 2)"),
])
def test_a_repeated_key_or_bad_yaml_exits_2_with_one_line(text, message, tmp_path):
    """The real ``grpo`` command: the line names the file, the line and the key."""
    path = tmp_path / "preset.yaml"
    path.write_text(text)
    proc = subprocess.run([sys.executable, "-m", "grpo.tools.cli", "check", "--params", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [f"grpo check: error: {path}:{message}"]
    assert path.read_text() == text


def test_check_refuses_a_preset_whose_validation_split_would_be_empty(tmp_path):
    """Seed 003's preset as it was (all of GSM8K's train split for training): the real CLI exits 2
    with one line naming the empty split and the evaluation interval that would meet it."""
    raw = yaml.safe_load((REPO / "presets/seed003.yaml").read_text())
    raw["data"]["train_size"] = 7473
    preset = tmp_path / "presets" / "old_seed003.yaml"
    preset.parent.mkdir()
    preset.write_text(yaml.safe_dump(raw))
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    proc = subprocess.run([sys.executable, "-m", "grpo.tools.cli", "check", "--params", str(preset), "--device", "cuda",
                           "--gpu-memory", "7.6"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1
    assert lines[0].startswith("grpo check: error: data.val_size: 200 validation rows asked, but there are none: ")
    assert "; train.checkpoints.eval_every: 50 evaluates data/raw/val.jsonl" in lines[0]