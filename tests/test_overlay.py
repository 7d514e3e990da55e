"""grpo.config.overlay: params put over a base (a preset's sections, or dotted keys as ``dvc exp run -S`` and
the flow's ``--set`` write them), the base left as it was; what it refuses, and what it leaves for
validation to name."""

from __future__ import annotations

import io

import pytest
from ruamel.yaml import YAML

from grpo.config.overlay import overlay_params
from grpo.config.params import params_from_dict
from grpo.core.errors import ParamsError


def test_overlay_takes_a_preset_or_dotted_keys_and_leaves_the_base_as_it_was():
    base = {"train": {"rewards": {"correctness": 1.0, "format_soft": 0.1}, "optimizer": {"lr": 1e-3}}, "data": None}
    assert overlay_params(base, {"train": {"rewards": {"correctness": 1.0}}, "lora": {"rank": 4}}) == {
        "train": {"rewards": {"correctness": 1.0}, "optimizer": {"lr": 1e-3}}, "data": {}, "lora": {"rank": 4}}  # a value whole
    assert overlay_params(base, {"train.optimizer.lr": 5e-4, "train.rewards.correctness": 2.0})["train"] == {
        "optimizer": {"lr": 5e-4}, "rewards": {"correctness": 2.0, "format_soft": 0.1}}  # a dotted key of any depth
    assert overlay_params(base, {"train": {"optimizer": {"warmup_steps": 0}}})["train"]["optimizer"] == {
        "lr": 1e-3, "warmup_steps": 0}  # a preset's part merged key by key
    assert base == {"train": {"rewards": {"correctness": 1.0, "format_soft": 0.1}, "optimizer": {"lr": 1e-3}}, "data": None}
    for bad, message in (({"train": 5}, "train: must be a mapping, got 5"),
                         ({"train.optimizer.lr.x": 1}, "train.optimizer.lr: must be a mapping, got 0.001 (to set train.optimizer.lr.x)")):
        with pytest.raises(ParamsError) as err:
            overlay_params(base, bad)
        assert str(err.value) == message


def test_nothing_over_nothing_is_empty_and_a_missing_section_or_key_is_added_for_validation_to_name():
    assert overlay_params(None, None) == {}
    assert overlay_params({"train": {"optimizer": {"lr": 0.1}}}, {}) == {"train": {"optimizer": {"lr": 0.1}}}
    added = overlay_params({"train": None}, {"lora.rank": 8, "train.zzz": 1})
    assert added == {"train": {"zzz": 1}, "lora": {"rank": 8}}
    with pytest.raises(ParamsError, match=r"^train\.zzz: unknown key"):  # left for validation, which names it
        params_from_dict(added)
    assert params_from_dict(overlay_params({"train": None}, {"lora.rank": 8})).lora.rank == 8


def test_a_ruamel_documents_comments_and_order_come_along():
    """``grpo.config.params.write_params`` writes the result back into the file: its comments stay."""
    yaml = YAML()
    doc = yaml.load("train:\n  lr: 0.001  # the step size\n  steps: 5\nlora:\n  rank: 4\n")
    out = io.StringIO()
    yaml.dump(overlay_params(doc, {"train.steps": 7}), out)
    assert out.getvalue() == "train:\n  lr: 0.001  # the step size\n  steps: 7\nlora:\n  rank: 4\n"
    assert doc["train"]["steps"] == 5
