"""Params validation: a bad value stops with one line that names the field."""

from __future__ import annotations

import pytest
import yaml

from grpo.config import (
    Params,
    ParamsError,
    TrainConfig,
    load_params,
    overlay_params,
    params_from_dict,
    read_params_yaml,
    reading_params,
    write_params,
)

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
        ({"train": {"entropy_rule": "low", "entropy_top_quantile": 1.0}}, "train.entropy_rule"),
        ({"train": {"entropy_rule": "middle"}}, "train.entropy_rule"),
        ({"train": {"policy_loss": "ppo"}}, "train.policy_loss"),
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
        ({"train": {"engine_weights": "nf4"}, "model": {"quantization": "none"}}, "train.engine_weights"),
    ],
)
def test_bad_values_name_the_field(raw, field):
    with pytest.raises(ParamsError) as err:
        params_from_dict(raw)
    message = str(err.value)
    assert message.startswith(field)
    assert "\n" not in message


@pytest.mark.parametrize(("raw", "message"), [
    ({"train": {"learning_rate": 1e-4}}, "train.learning_rate: unknown key; did you mean train.lr?"),
    ({"train": {"num_generations": 8}}, "train.num_generations: unknown key; did you mean train.group_size or "
                                        "train.generation_batch_size?"),
    ({"sent": {"num_sample": 4}}, "sent.num_sample: unknown key; did you mean sent.num_samples?"),
    ({"lora": {"r": 8}}, "lora.r: unknown key; did you mean lora.rank?"),
    ({"model": {"torch_dtype": "bfloat16"}}, "model.torch_dtype: unknown key; did you mean model.dtype?"),
    ({"train": {"zzz": 1}}, f"train.zzz: unknown key; train has no key like it ({len(TrainConfig.model_fields)} keys: "
                            "docs/configuration.md)"),
    ({"trainer": {}}, "trainer: unknown params section; did you mean train? (sections: data, evaluate, lora, model, "
                      "sent, train)"),
    ({"train": {"lr": "fast"}}, "train.lr: must be a number, got 'fast'"),
    ({"train": {"lr": "5e-4"}}, "train.lr: must be a number, got '5e-4' (YAML reads 5e-4 as text: write 5.0e-4)"),
    ({"train": {"lr": "0.5"}}, "train.lr: must be a number, got '0.5' (quoted: write 0.5 without quotes)"),
    ({"train": {"steps": "10"}}, "train.steps: must be an integer, got '10' (quoted: write 10 without quotes)"),
    ({"train": {"steps": "ten"}}, "train.steps: must be an integer, got 'ten'"),
    ({"train": {"steps": "1e3"}}, "train.steps: must be an integer, got '1e3'"),
])
def test_the_message_suggests_the_nearest_key_and_hints_only_at_numbers_written_as_text(raw, message):
    """An unknown key names the nearest known ones (difflib, and the names TRL and peft use for the
    same setting) instead of listing the section's keys; a string in a numeric field gets a hint
    only where it reads as a number."""
    with pytest.raises(ParamsError) as err:
        params_from_dict(raw)
    assert str(err.value) == message


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


def test_a_repeated_key_is_one_line_naming_it_and_both_lines(tmp_path):
    """PyYAML would keep the last ``steps`` silently; the params reader refuses it. A merge key
    (``<<``) and the same key in two sections are not repeats."""
    path = tmp_path / "params.yaml"
    path.write_text("train:\n  steps: 5\n  lr: 0.001\n  steps: 7\n")
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value) == f"{path}:4: duplicate key 'steps' (first at line 2); a mapping takes each key once"
    path.write_text("a: &x {k: 1, j: 0}\nb:\n  <<: *x\n  k: 2\nc: {k: 3}\n")
    assert read_params_yaml(path) == {"a": {"k": 1, "j": 0}, "b": {"k": 2, "j": 0}, "c": {"k": 3}}


@pytest.mark.parametrize(("text", "message"), [
    ("train:\n  steps: 5\n lr: [0.001\n", "3: not valid YAML (while parsing a block mapping: expected <block end>, "
                                           "but found '<block mapping start>', column 2)"),
    ("train: {steps: 5\n", "2: not valid YAML (while parsing a flow mapping: expected ',' or '}', but got "
                           "'<stream end>', column 1)"),
    ("- 1\n", " must be a mapping of sections, got [1]"),
])
def test_a_yaml_error_is_one_line_with_its_line(text, message, tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value) == f"{path}:{message}"


def test_write_params_refuses_a_repeated_key_in_its_file(tmp_path):
    path = tmp_path / "params.yaml"
    text = "train:\n  steps: 5\n  steps: 7\n"
    path.write_text(text)
    with pytest.raises(ParamsError, match=r"params.yaml:3: duplicate key 'steps' \(first at line 2\)"):
        write_params(path, {"train": {"lr": 0.1}})
    assert path.read_text() == text
