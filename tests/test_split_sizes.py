"""grpo.data.split_sizes: each source's real sizes per split (GSM8K's constants, a jsonl file's rows, the
arithmetic generator's questions per split against what the generator really draws, reasoning-gym's
templates) and the refusals of a split that would be empty or short."""

from __future__ import annotations

import json

import pytest

from grpo.config.sections.data_section import DataConfig
from grpo.core.jsonio import DataError
from grpo.data import arithmetic
from grpo.data.sources import GSM8K_ROWS, prepare_splits, split_of
from grpo.data.split_sizes import SPLITS, data_refusals, drawn_supply, expected_rows, supply


def test_gsm8ks_whole_train_split_leaves_no_validation_row():
    """train_size = all of GSM8K's train split: the validation split carved after it is empty."""
    cfg = DataConfig(source="gsm8k", train_size=GSM8K_ROWS["train"], test_size=GSM8K_ROWS["test"], val_size=200)
    found = supply(cfg)
    assert found.rows["val"] == 0
    refusals = data_refusals(cfg, found)
    assert len(refusals) == 1 and refusals[0].startswith("data.val_size: 200 validation rows asked, but there are none")


def test_gsm8k_validation_is_carved_from_the_rows_after_train():
    cfg = DataConfig(source="gsm8k", train_size=GSM8K_ROWS["train"] - 200, test_size=GSM8K_ROWS["test"], val_size=200)
    found = supply(cfg)
    assert data_refusals(cfg, found) == []
    assert expected_rows(cfg, found) == {"train": cfg.train_size, "test": cfg.test_size, "val": 200}
    assert f"rows {cfg.train_size}-{GSM8K_ROWS['train'] - 1}" in found.where["val"]


@pytest.mark.parametrize("split, size", [("train", GSM8K_ROWS["train"] + 1), ("test", GSM8K_ROWS["test"] + 1)])
def test_a_gsm8k_split_larger_than_gsm8ks_is_refused(split, size):
    cfg = DataConfig(source="gsm8k", **{f"{split}_size": size}, val_size=0)
    refusals = data_refusals(cfg, supply(cfg))
    assert refusals and refusals[0].startswith(f"data.{split}_size: {size} ") and f"only {GSM8K_ROWS[split]}" in refusals[0]


@pytest.mark.parametrize("operators", [["+", "/"], ["+", "-"]])
def test_the_arithmetic_count_is_what_the_generator_draws(operators):
    """A small space drawn long enough to exhaust it: the distinct questions per split (by the
    split that owns each operand multiset) are the count, split by split."""
    cfg = DataConfig(source="arithmetic", min_digits=1, max_digits=1, min_terms=2, max_terms=2, operators=operators)
    drawn = {s: set() for s in SPLITS}
    stream = arithmetic.generate(cfg.seed, min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=tuple(operators))
    for _, (question, _, expr) in zip(range(40_000), stream):
        drawn[split_of(expr.operand_set, cfg.seed)].add(question)
    assert supply(cfg).rows == {s: len(q) for s, q in drawn.items()}


def test_the_arithmetic_count_bounds_a_partial_draw():
    cfg = DataConfig(source="arithmetic", max_digits=1, min_terms=2, max_terms=3, operators=["-", "*", "/"])
    drawn = {s: set() for s in SPLITS}
    stream = arithmetic.generate(cfg.seed, min_terms=2, max_terms=3, min_digits=1, max_digits=1, operators=("-", "*", "/"))
    for _, (question, _, expr) in zip(range(5_000), stream):
        drawn[split_of(expr.operand_set, cfg.seed)].add(question)
    rows = supply(cfg).rows
    assert all(0 < len(drawn[s]) <= rows[s] for s in SPLITS)


def test_an_arithmetic_split_asked_beyond_its_questions_is_refused():
    cfg = DataConfig(source="arithmetic", max_digits=1, train_size=10, test_size=10, val_size=10)
    found = supply(cfg)
    big = DataConfig(source="arithmetic", max_digits=1, train_size=10, test_size=found.rows["test"] + 1, val_size=10)
    refusals = data_refusals(big, supply(big))
    assert len(refusals) == 1 and refusals[0].startswith(f"data.test_size: {found.rows['test'] + 1} test rows asked")


def test_the_default_passes_and_draws_what_it_asks():
    cfg = DataConfig()
    assert data_refusals(cfg, supply(cfg)) == []
    *_, stats = prepare_splits(cfg)
    assert data_refusals(cfg, drawn_supply(stats)) == []
    assert {s: stats[s] for s in SPLITS} == {"train": cfg.train_size, "test": cfg.test_size, "val": cfg.val_size}


def test_a_draw_short_of_its_size_is_refused():
    cfg = DataConfig(val_size=50)
    stats = {"source": "arithmetic", "train": cfg.train_size, "test": cfg.test_size, "val": 49}
    assert data_refusals(cfg, drawn_supply(stats)) == [
        "data.val_size: 50 validation rows asked, but there are only 49: arithmetic's draw"]


def test_a_jsonl_source_without_its_file_is_refused_naming_it(tmp_path):
    cfg = DataConfig(source="jsonl", path=str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(DataError, match=f"^data.path: {tmp_path}/nowhere.jsonl: file not found$"):
        supply(cfg)


def test_a_jsonl_file_cut_as_prepare_data_cuts_it(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}) + "\n" for i in range(12)))
    fits = DataConfig(source="jsonl", path=str(path), train_size=20, test_size=4, val_size=0)  # train: at most 20
    assert data_refusals(fits, supply(fits)) == []
    train, test, val, _ = prepare_splits(fits)
    assert expected_rows(fits, supply(fits))["train"] == len(train) and len(test) == 4
    no_val = DataConfig(source="jsonl", path=str(path), train_size=8, test_size=4, val_size=2)
    assert [r.split(":")[0] for r in data_refusals(no_val, supply(no_val))] == ["data.val_size"]
    no_train = DataConfig(source="jsonl", path=str(path), train_size=8, test_size=12, val_size=0)
    assert [r.split(":")[0] for r in data_refusals(no_train, supply(no_train))] == ["data.train_size"]


def test_gsm_symbolic_splits_own_reasoning_gyms_templates():
    from reasoning_gym.arithmetic.gsm_symbolic.gsm_symbolic import tasks_ok

    found = supply(DataConfig(source="gsm_symbolic"))
    owned = [int(found.where[s].split()[0]) for s in SPLITS]
    assert sum(owned) == len(tasks_ok) and all(owned)
    assert found.rows == dict.fromkeys(SPLITS)  # a template has no known bound
