"""Params validation: a bad value stops with one line that names the field."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from grpo.config import ParamsError, load_params, params_from_dict

from .conftest import REPO


def test_repo_params_yaml_is_valid():
    params = load_params(REPO / "params.yaml")
    assert params.model.quantization == "nf4"
    assert params.train.entropy_top_quantile == 0.2


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ({"train": {"lr": 0}}, "train.lr"),
        ({"train": {"lr": -1e-4}}, "train.lr"),
        ({"train": {"entropy_top_quantile": 0.0}}, "train.entropy_top_quantile"),
        ({"train": {"entropy_top_quantile": 1.5}}, "train.entropy_top_quantile"),
        ({"train": {"group_size": 1}}, "train.group_size"),
        ({"train": {"rewards": {"correctnes": 1.0}}}, "train.rewards"),
        ({"train": {"loss_type": "ppo"}}, "train.loss_type"),
        ({"train": {"steps": "ten"}}, "train.steps"),
        ({"train": {"learning_rate": 1e-4}}, "train.learning_rate"),
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"target_modules": "q_proj"}}, "lora.target_modules"),
        ({"model": {"quantization": "int3"}}, "model.quantization"),
        ({"trainer": {}}, "trainer"),
    ],
)
def test_bad_values_name_the_field(raw, field):
    with pytest.raises(ParamsError) as err:
        params_from_dict(raw)
    message = str(err.value)
    assert message.startswith(field)
    assert "\n" not in message


def test_defaults_fill_missing_sections():
    params = params_from_dict({"train": {"steps": 3}})
    assert params.train.steps == 3 and params.lora.rank == 16


def test_cli_bad_param_exits_nonzero_with_one_line_and_writes_nothing(tmp_path):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"].update(
        lr=-0.1, output_dir=str(tmp_path / "out"), adapter_dir=str(tmp_path / "adapter"), metrics_dir=str(tmp_path / "m")
    )
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(params))
    proc = subprocess.run(
        [sys.executable, "-m", "tasks.train", "--params", str(path)], cwd=REPO, capture_output=True, text=True
    )
    assert proc.returncode == 2
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert lines == ["train: error: train.lr: must be > 0, got -0.1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["params.yaml"]


@pytest.mark.parametrize("preset", ["params.yaml", "presets/seed003.yaml", "presets/seed001.yaml"])
def test_shipped_params_and_presets_validate(preset):
    from grpo.config import load_params

    params = load_params(REPO / preset)
    if "seed003" in preset:
        assert (params.train.group_size, params.train.max_new_tokens, params.train.lr) == (8, 512, 1e-4)
        assert (params.lora.rank, params.lora.alpha, params.train.beta, params.train.epsilon) == (16, 32, 0.0, 0.2)
    if "seed001" in preset:
        assert (params.train.group_size, params.train.max_new_tokens, params.train.beta) == (12, 400, 0.04)
        assert (params.train.epsilon, params.train.max_grad_norm) == (0.1, 0.1)


def test_sampling_dtype_auto_follows_native_bf16(tmp_path, monkeypatch):
    import grpo.config as config

    with_bf16, without = tmp_path / "a", tmp_path / "b"
    with_bf16.write_text("flags\t\t: fpu sse2 avx512f avx512_bf16 avx512_vnni\n")
    without.write_text("flags\t\t: fpu sse2 avx2 avx512f\n")
    assert config.cpu_has_native_bf16(with_bf16) and not config.cpu_has_native_bf16(without)
    assert not config.cpu_has_native_bf16(tmp_path / "missing")
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: False)
    assert config.sampling_dtype("auto", "cpu") == "float32"
    assert config.sampling_dtype("auto", "cuda") == "bfloat16"
    assert config.sampling_dtype("float32", "cuda") == "float32"
    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: True)
    assert config.sampling_dtype("auto", "cpu") == "bfloat16"
