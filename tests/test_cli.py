"""The ``grpo`` command: ``check`` (params, device, DVC status, memory estimate) and how it finds the
workspace under a preset (``ask``: tests/test_ask.py; the estimate's exact parts: tests/test_memory.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml

from grpo.core.jsonio import write_jsonl
from grpo.tools import cli

from .conftest import REPO
from .helpers import run

pytestmark = pytest.mark.usefixtures("quiet_cli_env")


@pytest.mark.parametrize("params", ["params.yaml", "presets/seed003.yaml", "presets/seed001.yaml"])
def test_check_prints_settings_device_dvc_and_the_estimate(params, capsys):
    code, out, err = run(capsys, "check", "--params", str(REPO / params), "--prompt-tokens", "100")
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].startswith("params: ") and lines[0].endswith(": valid")
    assert any(line.startswith("device: ") for line in lines)
    assert any(line.startswith("dvc: ") for line in lines)
    assert "memory: one training step on" in out
    for term in ("weights", "LoRA + AdamW", "KV cache", "activations", "generation total", "training total", "peak"):
        assert any(line.strip().startswith(term) for line in lines), term
    assert any(line.strip().startswith("measured") for line in lines)
    if params != "params.yaml":  # a preset is put over params.yaml: the stages it changes are named
        assert "this file changes" in out and "model.name" in out


def test_check_for_a_gpu_names_seed003s_measurement(capsys):
    code, out, _ = run(capsys, "check", "--params", str(REPO / "presets/seed003.yaml"), "--device", "cuda",
                       "--prompt-tokens", "128")
    assert code == 0
    assert "on cuda (bfloat16 compute)" in out and "dense 4-bit copies" not in out
    assert "seed 003's step" in out and "not measured yet" in out


def test_unknown_key_exits_2_with_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"train": {"learning_rate": 0.1}}))
    proc = subprocess.run([sys.executable, "-m", "grpo.tools.cli", "check", "--params", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stdout == ""
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == [f"grpo check: error: {path}: train.learning_rate: unknown key; did you mean train.optimizer.lr?"]


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


def test_estimate_without_a_config_says_so(tmp_path, capsys):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump({"model": {"name": "someone/unknown-model", "path": str(tmp_path / "none")}}))
    code, out, _ = run(capsys, "check", "--params", str(path))
    assert code == 0
    assert "memory: no estimate: the estimate needs the model's config.json" in out


def test_a_preset_is_estimated_for_its_own_model_where_another_was_prepared(tiny_model_dir, tiny_problems, tmp_path,
                                                                           capsys):
    """A workspace where the default pipeline ran: prepare_model wrote models/base (with its
    manifest.json) for params.yaml's model, prepare_data the arithmetic problems; ``check`` of seed
    003 there estimates the 1.5B model the preset names, not the directory (nor its prompts with
    that model's tokenizer), with the engine at ``--gpu-memory 8`` and 6; ``check`` of params.yaml
    still reads the directory and the problems."""
    import shutil

    from grpo.model.base_model import resolve_base_model

    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"model": {"name": str(tiny_model_dir),
                                                                    "path": "models/base"}}))
    resolve_base_model(str(tiny_model_dir), tmp_path / "models" / "base")  # as the prepare_model stage does
    write_jsonl(tmp_path / "data" / "raw" / "train.jsonl", tiny_problems)  # as prepare_data does
    (tmp_path / "data" / "raw" / "stats.json").write_text(json.dumps({"source": "arithmetic"}))
    (tmp_path / "presets").mkdir()
    shutil.copy(REPO / "presets" / "seed003.yaml", tmp_path / "presets" / "seed003.yaml")
    code, out, err = run(capsys, "check", "--params", str(tmp_path / "presets" / "seed003.yaml"), "--device", "cuda",
                         "--gpu-memory", "8")
    assert code == 0, err
    lines = [line.strip() for line in out.splitlines()]
    # not the tiny model's tokenizer on the arithmetic problems: the preset's prompt length is assumed
    assert "prompt 128 tokens (assumed" in out
    model = next(line for line in lines if line.startswith("model: "))
    assert "grpo.tools.synthetic architecture 'qwen2-1.5b'" in model and f"models/base holds {tiny_model_dir}" in model
    assert "hidden 1536" in model and "28 layers" in model
    # both phases with the engine, its arithmetic and the verdict for the card
    assert "engine: train.rollouts.engine_weights auto -> nf4 (auto: dense needs 3.95 GiB > the budget 0.96 GiB)" in out
    assert any(line.startswith("KV cache of one step") and "10,240 tokens (16 completions x 640" in line
               and "x 28 KiB/token (2 x 28 layers x 2 kv heads x 128 x 2 B)" in line for line in lines)
    assert any(line.startswith("budget") and "train.rollouts.gpu_memory_utilization 0.12 x 8.00 GiB" in line for line in lines)
    assert any(line.startswith("vLLM engine, awake") and "generate" in line for line in lines)
    assert any(line.startswith("vLLM engine, asleep") and "train" in line for line in lines)
    peak = next(line for line in lines if line.startswith("peak"))
    assert float(peak.split()[1]) <= 3.3  # seed 003 with the nf4 engine: the update's 2 micro-batches of 8 rows, 3.22
    assert "card 8.00 GiB: fits: peak" in out
    code, out, err = run(capsys, "check", "--params", str(tmp_path / "presets" / "seed003.yaml"), "--device", "cuda",
                         "--prompt-tokens", "128", "--gpu-memory", "4.1")
    assert code == 0, err
    assert "card 4.10 GiB: does not fit: the engine's budget 503.8 MiB < its needs 714.6 MiB (nf4); turn " \
           "train.rollouts.gpu_memory_utilization: between 0.18 and 0.43" in out
    code, out, err = run(capsys, "check", "--params", str(tmp_path / "params.yaml"), "--device", "cuda")
    assert code == 0, err
    model = next(line for line in out.splitlines() if line.strip().startswith("model: "))
    assert f"{tmp_path / 'models' / 'base' / 'config.json'}" in model and "hidden 64" in model
    assert f"(the longest prompt of {tmp_path / 'data' / 'raw' / 'train.jsonl'})" in out


@pytest.mark.parametrize(("gib", "fits"), [("24", True), ("1", False)])
def test_check_for_a_card_prints_the_saved_model_engines_and_a_verdict_per_stage(gib, fits, capsys):
    """``--device cuda --gpu-memory GIB``: SENT's and the evaluations' engines bounded to one call
    (seed 003: 16 prompts x 8 samples -> 128; 64 x 1 greedy -> 64), then one verdict line a
    stage: sent, the evaluations, train."""
    code, out, err = run(capsys, "check", "--params", str(REPO / "presets/seed003.yaml"), "--device", "cuda",
                         "--prompt-tokens", "128", "--gpu-memory", gib)
    assert code == 0, err
    lines = out.splitlines()
    assert "memory: the saved-model engines on cuda, one generation call each, estimated" in lines
    assert any(line.startswith("  sent: the base in bfloat16; max_num_seqs 128 (sent.batch_prompts 16 x num_samples 8")
               for line in lines)
    assert any(line.startswith("  baseline_eval, final_eval: the policy exported dense in bfloat16; max_num_seqs 64 ")
               for line in lines)
    start = lines.index("verdict per stage:") + 1
    stages = [line for line in lines[start:next(i for i, line in enumerate(lines) if line.startswith("time: "))]
              if not line.startswith("    ")]  # the modelled times follow; the decode loop's lines are indented under theirs
    loops = [line for line in lines[start:] if line.startswith("    without vLLM")]
    assert len(loops) == 2 and all("the decode loop" in line for line in loops), loops
    assert [line.split(":")[0].strip() for line in stages] == ["sent", "baseline_eval, final_eval", "train"]
    card = f"card {float(gib):.2f} GiB: "
    verdict = "fits: " if fits else "does not fit: "
    assert all(line.split(": ", 1)[1].startswith(card + verdict) for line in stages), stages
    train = cli.resolve_params(REPO / "presets/seed003.yaml").params.train  # the rule the preset resolves to
    rule = f"; estimated for train.loss.entropy_rule {train.loss.entropy_rule} (top_quantile {train.loss.rule_options().top_quantile})"
    assert stages[-1].endswith(rule), stages[-1]


def test_a_card_size_that_is_not_positive_is_one_line(capsys):
    code, out, err = run(capsys, "check", "--params", str(REPO / "params.yaml"), "--gpu-memory", "0")
    assert (code, out, err.strip()) == (2, "", "grpo check: error: --gpu-memory: must be > 0 GiB")


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


def test_check_says_what_each_training_process_samples_with(tmp_path, capsys):
    """The train stage's rule (``grpo.rollout.rollout_backends.uses_engine``): with vLLM installed every process runs
    an engine of its own; the decode loop with ``rollout_backend: transformers`` (the stage test
    with 2 real processes compares this line with its log: tests/test_distributed.py)."""
    import importlib.util

    from grpo.rollout.rollout_backends import uses_engine

    for backend, processes in (("auto", 2), ("transformers", 2), ("vllm", 1)):
        (tmp_path / "p.yaml").write_text(yaml.safe_dump(
            {"train": {"distribution": {"num_processes": processes}, "rollouts": {"prompts_per_step": 4, "backend": backend}}}))
        code, out, err = run(capsys, "check", "--params", str(tmp_path / "p.yaml"))
        assert code == 0, err
        line = next(x.strip() for x in out.splitlines() if x.strip().startswith("rollouts:"))
        who = "the process" if processes == 1 else f"each of {processes} processes"
        if uses_engine(backend):
            assert line.startswith(f"rollouts: {who}: a vLLM engine of its own holding the policy (dense weights)")
        else:
            assert line.startswith(f"rollouts: {who}: the decode loop on the policy (transformers)")
    assert uses_engine("auto") == (importlib.util.find_spec("vllm") is not None)


def test_check_names_the_device_it_estimates_for_and_this_machine(monkeypatch, capsys):
    """``--device cuda`` on a CPU machine: the estimate is for CUDA, the machine is named apart."""
    import torch

    monkeypatch.setattr(torch.version, "cuda", None)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.delenv("GRPO_DEVICE", raising=False)
    code, out, _ = run(capsys, "check", "--params", str(REPO / "params.yaml"), "--prompt-tokens", "100",
                       "--device", "cuda")
    (line,) = [x for x in out.splitlines() if x.startswith("device: ")]
    assert code == 0 and line.startswith("device: estimating for cuda (--device); this machine: CPU: ")
    assert " cores" in line
    code, out, _ = run(capsys, "check", "--params", str(REPO / "params.yaml"), "--prompt-tokens", "100")
    (line,) = [x for x in out.splitlines() if x.startswith("device: ")]
    assert code == 0 and line.startswith("device: estimating for this machine: CPU: ")


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


def test_check_prints_the_splits_of_seed003(capsys):
    code, out, err = run(capsys, "check", "--params", str(REPO / "presets/seed003.yaml"), "--prompt-tokens", "100")
    assert code == 0, err
    splits = [line.strip() for line in out.splitlines() if line.startswith("  splits") or line.startswith(" " * 12)]
    p = cli.resolve_params(REPO / "presets/seed003.yaml").params.data
    assert f"splits    training {p.train_size} of {p.train_size} asked" in out
    assert any(line.startswith(f"validation {p.val_size} of {p.val_size} asked (GSM8K's train split after its first "
                               f"{p.train_size} rows") for line in splits)
