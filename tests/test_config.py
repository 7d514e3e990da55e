"""Params validation: a bad value stops with one line that names the field."""

from __future__ import annotations

import pytest
import yaml

from grpo.config import Params, ParamsError, load_params, overlay_params, params_from_dict, reading_params, write_params

from .conftest import REPO
from .helpers import _keys


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
        ({"train": {"entropy_keep": "low", "entropy_top_quantile": 1.0}}, "train.entropy_keep"),
        ({"train": {"order": "backwards"}}, "train.order"),
        ({"train": {"rewards": {"correctnes": 1.0}}}, "train.rewards"),
        ({"train": {"loss_type": "ppo"}}, "train.loss_type"),
        ({"train": {"steps": "ten"}}, "train.steps"),
        ({"train": {"learning_rate": 1e-4}}, "train.learning_rate"),
        ({"lora": {"rank": 0}}, "lora.rank"),
        ({"lora": {"target_modules": "q_proj"}}, "lora.target_modules"),
        ({"model": {"quantization": "int3"}}, "model.quantization"),
        ({"trainer": {}}, "trainer"),
        ({"train": {"lr": "5e-4"}}, "train.lr"),
        ({"train": {"steps": True}}, "train.steps"),
        ({"data": {"source": "jsonl"}}, "data.path"),
        ({"data": {"operators": ["+", "^"]}}, "data.operators"),
        ({"sent": {"gpu_memory_utilization": 1.5}}, "sent.gpu_memory_utilization"),
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
    assert params.train.steps == 3 and params.lora == Params().lora
    assert params.train.model_dump() == {**Params().train.model_dump(), "steps": 3}


@pytest.mark.parametrize("preset", ["params.yaml", "presets/seed003.yaml", "presets/seed001.yaml"])
def test_shipped_params_and_presets_validate(preset):
    load_params(REPO / preset)


def test_params_yaml_is_complete_and_equals_the_code_defaults():
    """One home for defaults: params.yaml names every field, and the code's defaults are the same
    values, so a key left out of a params file never changes the run."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    defaults = Params().model_dump()
    assert _keys(raw) == _keys(defaults), "params.yaml and the config fields differ"
    assert load_params(REPO / "params.yaml").model_dump() == defaults
    for section, fields in raw.items():  # the same value, key by key (a clearer failure)
        for key, value in fields.items():
            assert defaults[section][key] == value, f"{section}.{key}: params.yaml {value!r} != default"


def test_a_key_left_out_takes_the_params_yaml_value():
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, fields in raw.items():
        for key in fields:
            partial = {s: {k: v for k, v in f.items() if (s, k) != (section, key)} for s, f in raw.items()}
            assert params_from_dict(partial) == load_params(REPO / "params.yaml"), f"{section}.{key}"


def test_reading_params_records_fields_read():
    params = Params()
    with reading_params() as reads:
        _ = params.train.lr, params.model.path, params.train.lr
    _ = params.lora.rank  # outside the block: not recorded
    assert reads == {"train.lr", "model.path"}


def test_overlay_takes_a_preset_or_dotted_keys_and_leaves_the_base_as_it_was():
    base = {"train": {"lr": 1e-3, "rewards": {"correctness": 1.0, "format_soft": 0.1}}, "data": None}
    assert overlay_params(base, {"train": {"rewards": {"correctness": 1.0}}, "lora": {"rank": 4}}) == {
        "train": {"lr": 1e-3, "rewards": {"correctness": 1.0}}, "data": {}, "lora": {"rank": 4}}  # a value whole
    assert overlay_params(base, {"train.lr": 5e-4, "train.rewards.correctness": 2.0})["train"] == {
        "lr": 5e-4, "rewards": {"correctness": 2.0, "format_soft": 0.1}}  # a dotted key of any depth
    assert base == {"train": {"lr": 1e-3, "rewards": {"correctness": 1.0, "format_soft": 0.1}}, "data": None}
    for bad, message in (({"train": 5}, "train: must be a mapping, got 5"),
                         ({"train.lr.x": 1}, "train.lr: must be a mapping, got 0.001 (to set train.lr.x)")):
        with pytest.raises(ParamsError) as err:
            overlay_params(base, bad)
        assert str(err.value) == message


def test_write_params_keeps_comments_writes_floats_yaml11_reads_and_refuses_a_bad_result(tmp_path):
    target = tmp_path / "params.yaml"
    target.write_text((REPO / "params.yaml").read_text())
    params = write_params(target, {"train.lr": 5e-6, "train.steps": 60})  # the flow's --set form
    text = target.read_text()
    assert "# Embedded default" in text and "lr: 5.0e-06" in text  # `5e-06` would be text to PyYAML
    assert params == load_params(target) and (params.train.lr, params.train.steps) == (5e-6, 60)
    with pytest.raises(ParamsError) as err:
        write_params(target, {"train.lr": "fast"})
    assert str(err.value).startswith("train.lr: must be a number") and target.read_text() == text
