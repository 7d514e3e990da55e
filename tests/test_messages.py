"""grpo.core.messages: the one-line wording of invalid params: a pydantic error as ``section.key: what is
wrong``, the did-you-mean of an unknown key or section (with the names other tools use, ``ALIASES``),
the hint for a number written as text, and a YAML file's error with its line."""

from __future__ import annotations

import pytest
import yaml

from grpo.config.params import load_params, params_from_dict
from grpo.config.reading import ParamsError
from grpo.config.sections.train import TrainConfig
from grpo.core.messages import ALIASES, did_you_mean, suggest, unknown_section, yaml_error_line


@pytest.mark.parametrize(("raw", "message"), [
    ({"train": {"learning_rate": 1e-4}}, "train.learning_rate: unknown key; did you mean train.optimizer.lr?"),
    ({"train": {"num_generations": 8}}, "train.num_generations: unknown key; did you mean train.rollouts.group_size?"),
    ({"train": {"rollouts": {"num_generations": 8}}}, "train.rollouts.num_generations: unknown key; did you mean "
                                                      "train.rollouts.group_size or train.rollouts.generation_batch_size?"),
    ({"sent": {"num_sample": 4}}, "sent.num_sample: unknown key; did you mean sent.num_samples?"),
    ({"lora": {"r": 8}}, "lora.r: unknown key; did you mean lora.rank?"),
    ({"model": {"torch_dtype": "bfloat16"}}, "model.torch_dtype: unknown key; did you mean model.dtype?"),
    ({"train": {"zzz": 1}}, f"train.zzz: unknown key; train has no key like it ({len(TrainConfig.model_fields)} keys: "
                            "docs/configuration.md)"),
    ({"trainer": {}}, "trainer: unknown params section; did you mean train? (sections: data, decode, evaluate, lora, "
                      "model, sent, train)"),
    ({"train": {"optimizer": {"lr": "fast"}}}, "train.optimizer.lr: must be a number, got 'fast'"),
    ({"train": {"optimizer": {"lr": "5e-4"}}}, "train.optimizer.lr: must be a number, got '5e-4' (YAML reads 5e-4 as text: write 5.0e-4)"),
    ({"train": {"optimizer": {"lr": "0.5"}}}, "train.optimizer.lr: must be a number, got '0.5' (quoted: write 0.5 without quotes)"),
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


@pytest.mark.parametrize(("raw", "message"), [
    ({"model": {"quantization": "int3"}}, "model.quantization: must be one of nf4, none; got 'int3'"),
    ({"lora": {"rank": 0}}, "lora.rank: must be > 0, got 0"),
    ({"train": {"rollouts": {"group_size": 1}}}, "train.rollouts.group_size: must be >= 2, got 1"),
    ({"train": {"loss": {"entropy_rule_options": {"archer": {"top_quantile": 1.5}}}}}, "train.loss.entropy_rule_options.archer.top_quantile: must be <= 1, got 1.5"),  # 1.0 as 1
    ({"train": {"steps": True}}, "train.steps: must be an integer, got True"),
    ({"lora": {"target_modules": "q_proj"}}, "lora.target_modules: must be a list, got 'q_proj'"),
])
def test_a_bad_value_says_what_the_field_takes_in_the_projects_words(raw, message):
    """pydantic's error kinds (a literal, a bound, a type) as one line: the choices without quotes, a
    bound that is a whole number written as one, the value as given."""
    with pytest.raises(ParamsError) as err:
        params_from_dict(raw)
    assert str(err.value) == message


def test_suggest_puts_the_alias_first_where_the_section_has_it_then_the_nearest_spellings():
    assert ALIASES["learning_rate"] == "lr"
    assert suggest("learning_rate", {"lr", "lr_schedule", "learning"}) == ["lr", "learning"]  # lr: no close spelling
    assert suggest("num_iterations", {"num_iteration", "steps"}) == ["num_iteration"]  # its alias mu: not here
    assert suggest("r", {"alpha", "dropout"}) == []  # rank is not in this section
    near = suggest("rank", {"rank1", "rank2", "rank3", "rank4"}, n=2)
    assert len(near) == 2 and set(near) < {"rank1", "rank2", "rank3", "rank4"}  # at most n


def test_did_you_mean_words_one_name_or_a_list_ending_in_or():
    assert did_you_mean("train.", ["lr"]) == "train.lr"
    assert did_you_mean("", ["a", "b", "c"]) == "a, b or c"
    assert unknown_section("lroa", ("train", "lora", "model")) == (
        "lroa: unknown params section; did you mean lora? (sections: lora, model, train)")
    assert unknown_section("zzz", ("train", "lora")) == "zzz: unknown params section; (sections: lora, train)"


@pytest.mark.parametrize(("text", "message"), [
    ("train:\n  steps: 5\n lr: [0.001\n", "3: not valid YAML (while parsing a block mapping: expected <block end>, "
                                           "but found '<block mapping start>', column 2)"),
    ("train: {steps: 5\n", "2: not valid YAML (while parsing a flow mapping: expected ',' or '}', but got "
                           "'<stream end>', column 1)"),
    ("train:\n  steps: 5\n  lr: 0.001\n  steps: 7\n", "4: duplicate key 'steps' (first at line 2); a mapping takes "
                                                      "each key once"),
])
def test_a_yaml_error_is_one_line_with_its_line(text, message, tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text(text)
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value) == f"{path}:{message}"


def test_a_yaml_error_without_a_place_is_one_line_naming_the_file(tmp_path):
    path = tmp_path / "params.yaml"
    assert yaml_error_line(path, yaml.YAMLError("cannot read\n  this")) == f"{path}: not valid YAML (cannot read this)"
