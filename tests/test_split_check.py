"""grpo.data.split_check: training's use of the splits (an evaluation interval with no validation row,
a curriculum stage smaller than a step) at the source's sizes (``check_params``) and on the files
the train stage reads (``check_training_files``)."""

from __future__ import annotations

import pytest

from grpo.config.params import params_from_dict
from grpo.config.sections.train import TrainConfig
from grpo.core.jsonio import DataError, write_jsonl
from grpo.data.split_check import check_params, check_training_files, train_refusals


def _params(data: dict, train: dict | None = None):
    return params_from_dict({"data": data, "train": train or {}})


def test_eval_every_without_a_validation_split_is_refused():
    with pytest.raises(DataError, match=r"^train\.checkpoints\.eval_every: 10 evaluates data/raw/val\.jsonl every 10 steps, "
                                        r"but it holds no row \(prepare_data writes 0 from data\.val_size 0\)"):
        check_params(_params({"val_size": 0}))


def test_no_validation_split_and_no_evaluation_passes():
    lines = check_params(_params({"val_size": 0}, {"checkpoints": {"eval_every": 0}}))
    assert any(line.startswith("validation 0 of 0 asked") for line in lines)


def test_an_empty_gsm8k_validation_split_is_refused_twice_in_one_line():
    with pytest.raises(DataError) as err:
        check_params(_params({"source": "gsm8k", "train_size": 7473, "test_size": 1319}, {"checkpoints": {"eval_every": 50}}))
    keys = [part.split(":")[0] for part in str(err.value).split("; ")]
    assert keys == ["data.val_size", "train.checkpoints.eval_every"] and "\n" not in str(err.value)


def test_a_stage_smaller_than_a_step_is_refused_and_more_steps_than_rows_is_not():
    """10 rows in 4 stages (2 or 3 rows): 3 prompts a step would repeat a problem; 2 prompts for
    many steps only wrap around each stage."""
    many = TrainConfig(steps=100, rollouts={"prompts_per_step": 2})
    assert train_refusals(many, 10, None, "") == []
    refusals = train_refusals(TrainConfig(rollouts={"prompts_per_step": 3}), 10, None, "")
    assert len(refusals) == 1 and refusals[0].startswith("train.rollouts.prompts_per_step: 3 prompts a step, but "
                                                         "train.order curriculum's smallest stage holds 2 of the 10")


def test_the_train_stage_check_reads_its_files(tmp_path):
    rows = [{"id": str(i), "question": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(8)]
    write_jsonl(tmp_path / "train.jsonl", rows)
    write_jsonl(tmp_path / "val.jsonl", [])
    cfg = TrainConfig(data_path=str(tmp_path / "train.jsonl"), rollouts={"prompts_per_step": 2},
                      checkpoints={"val_path": str(tmp_path / "val.jsonl"), "eval_every": 5})
    with pytest.raises(DataError, match=r"^train\.checkpoints\.eval_every: 5 .* holds no row \(the file\)"):
        check_training_files(cfg)
    write_jsonl(tmp_path / "val.jsonl", rows[:2])
    check_training_files(cfg)  # passes
