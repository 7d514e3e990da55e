"""Params validation: a bad value stops with one line that names the field."""

from __future__ import annotations

import pytest

from grpo.config import ParamsError, read_params_yaml, reading_params
from grpo.overlay import overlay_params
from grpo.params import AllParams, load_params


def test_reading_params_records_fields_read():
    params = AllParams()
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




def test_load_sections_validates_the_sections_named_and_only_checks_the_others_are_sections(tmp_path):
    """A stage loads what it reads: a bad key of a section it does not load is the other stages'
    to refuse; an unknown section is refused by every stage."""
    from grpo.config import load_sections
    from grpo.sections.data_section import DataConfig
    from grpo.sections.shared import TrainSharedKeys
    from grpo.sections.train import TrainConfig

    path = tmp_path / "params.yaml"
    path.write_text("data:\n  seed: 3\ntrain:\n  lr: -1.0\n  system_prompt: Be brief.\n")
    params = load_sections(path, DataConfig, TrainSharedKeys)
    assert (params.data.seed, params.train.system_prompt, params.train.metrics_dir) == (3, "Be brief.", "metrics")
    with pytest.raises(AttributeError):
        _ = params.model
    with pytest.raises(ParamsError, match=r"^train\.lr: must be > 0, got -1\.0$"):
        load_sections(path, TrainConfig)
    path.write_text("data:\n  seed: 3\ntrainer: {}\n")
    with pytest.raises(ParamsError, match=r"^trainer: unknown params section; did you mean train\?"):
        load_sections(path, DataConfig)
