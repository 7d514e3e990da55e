"""grpo.config.params: every section of a file together; params.yaml equals the code's defaults."""

from __future__ import annotations

import pytest
import yaml

from grpo.config.params import AllParams, load_params, params_from_dict, write_params
from grpo.config.reading import ParamsError

from .conftest import REPO
from .helpers import _keys


def test_repo_params_yaml_is_valid():
    params = load_params(REPO / "params.yaml")
    loss = yaml.safe_load((REPO / "params.yaml").read_text())["train"]["loss"]
    assert params.model.quantization == "nf4"
    assert params.train.loss.rule_options() == params.train.loss.entropy_rule_options.get(loss["entropy_rule"])
    assert params.train.loss.rule_options().top_quantile == loss["entropy_rule_options"][loss["entropy_rule"]]["top_quantile"]


def test_defaults_fill_missing_sections():
    params = params_from_dict({"train": {"steps": 3}})
    assert params.train.steps == 3 and params.lora == AllParams().lora
    assert params.train.model_dump() == {**AllParams().train.model_dump(), "steps": 3}


@pytest.mark.parametrize("preset", ["params.yaml", "presets/seed003.yaml", "presets/seed001.yaml"])
def test_shipped_params_and_presets_validate(preset):
    load_params(REPO / preset)


def test_params_yaml_is_complete_and_equals_the_code_defaults():
    """One home for defaults: params.yaml names every field, and the code's defaults are the same
    values, so a key left out of a params file never changes the run."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    defaults = AllParams().model_dump()
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


def test_write_params_keeps_comments_writes_floats_yaml11_reads_and_refuses_a_bad_result(tmp_path):
    target = tmp_path / "params.yaml"
    target.write_text((REPO / "params.yaml").read_text())
    params = write_params(target, {"train.optimizer.lr": 5e-6, "train.steps": 60})  # the flow's --set form
    text = target.read_text()
    assert "# Embedded default" in text and "lr: 5.0e-06" in text  # `5e-06` would be text to PyYAML
    assert params == load_params(target) and (params.train.optimizer.lr, params.train.steps) == (5e-6, 60)
    with pytest.raises(ParamsError) as err:
        write_params(target, {"train.optimizer.lr": "fast"})
    assert str(err.value).startswith("train.optimizer.lr: must be a number") and target.read_text() == text


def test_write_params_refuses_a_repeated_key_in_its_file(tmp_path):
    path = tmp_path / "params.yaml"
    text = "train:\n  steps: 5\n  steps: 7\n"
    path.write_text(text)
    with pytest.raises(ParamsError, match=r"params.yaml:3: duplicate key 'steps' \(first at line 2\)"):
        write_params(path, {"train": {"optimizer": {"lr": 0.1}}})
    assert path.read_text() == text
