"""Data sources: generators, the user's JSONL, the hub source offline, disjoint splits, determinism."""

import json

import pytest

from grpo.config.reading import ParamsError
from grpo.config.sections.data_section import DataConfig
from grpo.config.sections.evaluate_section import EvaluateConfig
from grpo.config.sections.shared import DEFAULT_SYSTEM_PROMPT
from grpo.core.jsonio import DataError
from grpo.data.sources import (
    build_prompt,
    load_gsm8k,
    load_user_jsonl,
    prepare_splits,
    prompts_that_fit,
    skipped_line,
    split_disjoint,
)


def test_gsm_symbolic_rows_have_solution_and_numeric_answer():
    train, test, val, stats = prepare_splits(DataConfig(source="gsm_symbolic", train_size=6, test_size=4, val_size=3))
    assert stats["train"] == 6 and len(test) == stats["test"] and len(val) == stats["val"] > 0
    for row in train + test + val:
        assert set(row) == {"id", "question", "answer", "solution"}
        assert row["solution"]
        float(row["answer"].split("/")[0])


def test_splits_share_no_question():
    train = [{"question": q} for q in ["a", "b", "a", "c"]]
    test = [{"question": q} for q in ["c", "d", "e"]]
    tr, te, dropped = split_disjoint(train, test)
    assert [r["question"] for r in tr] == ["a", "b", "c"]
    assert [r["question"] for r in te] == ["d", "e"] and dropped == 1


def test_user_jsonl_rejects_bad_rows_saying_why(tmp_path):
    path = tmp_path / "mine.jsonl"
    lines = [
        json.dumps({"question": "What is 2+2?", "answer": "4"}),
        json.dumps({"question": "Big?", "answer": "#### 1,000", "solution": "count"}),
        json.dumps({"question": "No answer"}),
        json.dumps({"question": "", "answer": "3"}),
        json.dumps({"question": "Word answer", "answer": "seven"}),
        "not json",
        "",
    ]
    path.write_text("\n".join(lines) + "\n")
    rows, rejected = load_user_jsonl(path)
    assert [r["answer"] for r in rows] == ["4", "1000"] and rows[1]["solution"] == "count"
    assert rejected == ["line 3: no answer", "line 4: empty question", "line 5: answer 'seven' is not a number",
                        "line 6: not JSON"]
    assert skipped_line(path, rejected) == (f"{path}: 4 rows skipped: line 3: no answer; line 4: empty question; "
                                            "line 5: answer 'seven' is not a number; and 1 more")
    assert skipped_line(path, rejected[3:]) == f"{path}: 1 row skipped: line 6: not JSON"


def test_user_jsonl_missing_or_empty_fails_naming_the_file(tmp_path):
    with pytest.raises(DataError, match="nope.jsonl: file not found"):
        load_user_jsonl(tmp_path / "nope.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"q": 1}) + "\n")
    with pytest.raises(DataError, match="bad.jsonl: no valid rows"):
        load_user_jsonl(bad)


def test_jsonl_source_splits_by_seed(tmp_path):
    path = tmp_path / "mine.jsonl"
    path.write_text("".join(json.dumps({"question": f"q{i}", "answer": str(i)}) + "\n" for i in range(20)))
    cfg = DataConfig(source="jsonl", path=str(path), train_size=10, test_size=5, val_size=3)
    train, test, val, stats = prepare_splits(cfg)
    assert len(test) == 5 and len(train) == 10 and len(val) == 3 and stats["rejected_rows"] == 0
    assert not {r["question"] for r in train} & {r["question"] for r in test}
    assert not {r["question"] for r in val} & {r["question"] for r in train + test}
    with pytest.raises(DataError, match="test_size"):
        prepare_splits(DataConfig(source="jsonl", path=str(path), test_size=20))


@pytest.mark.parametrize("source", ["arithmetic", "gsm_symbolic"])
def test_validation_split_is_disjoint_and_leaves_train_and_test_unchanged(source):
    kw = dict(source=source, train_size=40, test_size=30, max_digits=2)
    without = prepare_splits(DataConfig(**kw, val_size=0))
    train, test, val, stats = prepare_splits(DataConfig(**kw, val_size=30))
    assert (train, test) == without[:2] and without[2] == []
    assert val and stats["val"] == len(val) and len({r["question"] for r in val}) == len(val)
    assert not {r["question"] for r in val} & {r["question"] for r in train + test}


def test_jsonl_source_needs_a_path():
    with pytest.raises(ParamsError, match="data.path"):
        DataConfig(source="jsonl")


def test_gsm8k_offline_fails_with_one_clear_line(monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    with pytest.raises(DataError) as err:
        load_gsm8k("train", 4)
    msg = str(err.value)
    assert "\n" not in msg and "openai/gsm8k" in msg and "gsm_symbolic, arithmetic or jsonl" in msg


def test_prompts_that_do_not_fit_max_model_len_are_skipped_with_one_warning(caplog):
    """A 100 kB question (and one just over the budget) is skipped with one WARNING naming the file,
    the row and the key; the rows that fit keep their order and prompts; none fitting is a DataError."""
    from grpo.tools.synthetic import char_tokenizer

    tok = char_tokenizer()
    short = len(tok(build_prompt(tok, "", DEFAULT_SYSTEM_PROMPT), add_special_tokens=False)["input_ids"])
    cfg = EvaluateConfig(max_model_len=short + 40, max_new_tokens=10)  # room for a 30-character question
    rows = [{"id": "a", "question": "1 + 1?"}, {"id": "huge", "question": "7 " * 50_000},
            {"id": "b", "question": "x" * 30}, {"id": "c", "question": "x" * 31}]
    with caplog.at_level("WARNING", logger="grpo.data.sources"):
        kept, prompts = prompts_that_fit(tok, rows, DEFAULT_SYSTEM_PROMPT, cfg, "data/raw/test.jsonl")
    assert [r["id"] for r in kept] == ["a", "b"]
    assert prompts == [build_prompt(tok, r["question"], DEFAULT_SYSTEM_PROMPT) for r in kept]
    budget = f"+ 10 new > evaluate.max_model_len {cfg.max_model_len}"
    assert [r.getMessage() for r in caplog.records] == [
        f"data/raw/test.jsonl: 2 rows skipped: id 'huge': prompt of {short + 100_000} tokens {budget}; "
        f"id 'c': prompt of {short + 31} tokens {budget}"]
    with pytest.raises(DataError, match=r"^evaluate.max_model_len: no prompt of data/raw/test.jsonl fits; "
                                        r"data/raw/test.jsonl: 1 row skipped: id 'huge'"):
        prompts_that_fit(tok, rows[1:2], DEFAULT_SYSTEM_PROMPT, cfg, "data/raw/test.jsonl")
