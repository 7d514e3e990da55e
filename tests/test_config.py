"""Params validation: a bad value stops with one line that names the field."""

from __future__ import annotations

import pytest
import yaml

from grpo.config import Params, ParamsError, load_params, params_from_dict, reading_params

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
