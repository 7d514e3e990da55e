"""grpo.config.reading: the params reader (repeated keys, a document that is not a mapping), the record of
fields read, and loading only the sections a stage reads. The messages' wording: tests/test_messages.py;
overlaying params: tests/test_overlay.py."""

from __future__ import annotations

import pytest

from grpo.config.params import AllParams, load_params
from grpo.config.reading import ParamsError, read_params_yaml
from grpo.core.fields import reading_params


def test_reading_params_records_fields_read():
    params = AllParams()
    with reading_params() as reads:
        _ = params.train.optimizer.lr, params.model.path, params.train.optimizer.lr
    _ = params.lora.rank  # outside the block: not recorded
    assert reads == {"train.optimizer.lr", "model.path"}


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


def test_a_document_that_is_not_a_mapping_is_one_line_naming_the_file(tmp_path):
    """The reader's own refusal (a YAML error's wording, with its line: tests/test_messages.py)."""
    path = tmp_path / "params.yaml"
    path.write_text("- 1\n")
    with pytest.raises(ParamsError) as err:
        load_params(path)
    assert str(err.value) == f"{path}: must be a mapping of sections, got [1]"


def test_load_sections_validates_the_sections_named_and_only_checks_the_others_are_sections(tmp_path):
    """A stage loads what it reads: a bad key of a section it does not load is the other stages'
    to refuse; an unknown section is refused by every stage."""
    from grpo.config.reading import load_sections
    from grpo.config.sections.data_section import DataConfig
    from grpo.config.sections.shared import OtherStagesTrainKeys
    from grpo.config.sections.train import TrainConfig

    path = tmp_path / "params.yaml"
    path.write_text("data:\n  seed: 3\ntrain:\n  optimizer:\n    lr: -1.0\n  system_prompt: Be brief.\n")
    params = load_sections(path, DataConfig, OtherStagesTrainKeys)
    assert (params.data.seed, params.train.system_prompt, params.train.metrics_dir) == (3, "Be brief.", "metrics")
    with pytest.raises(AttributeError):
        _ = params.model
    with pytest.raises(ParamsError, match=r"^train\.optimizer\.lr: must be > 0, got -1\.0$"):
        load_sections(path, TrainConfig)
    path.write_text("data:\n  seed: 3\ntrainer: {}\n")
    with pytest.raises(ParamsError, match=r"^trainer: unknown params section; did you mean train\?"):
        load_sections(path, DataConfig)
