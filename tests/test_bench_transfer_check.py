"""bench/transfer_check.py's probe sets: other wordings over operand sets the split gives to test only,
three-digit sums; every label is the sum its question states."""

from __future__ import annotations

import importlib.util
import re

from grpo.config.sections.data_section import DataConfig
from grpo.data.sources import split_of
from tests.conftest import REPO

spec = importlib.util.spec_from_file_location("transfer_check", REPO / "bench" / "transfer_check.py")
transfer_check = importlib.util.module_from_spec(spec)
spec.loader.exec_module(transfer_check)


def test_other_wordings_use_only_the_test_shares_operands_and_never_the_generators_phrasings():
    data = DataConfig()
    rows = transfer_check.other_wordings(120, data, data.seed)
    assert len(rows) == 120 and len({r["question"] for r in rows}) > 100
    for r in rows:
        a, b = (int(x) for x in re.findall(r"\d+", r["question"]))
        assert split_of((min(a, b), max(a, b)), data.seed) == "test"  # never a training problem's operands
        assert r["answer"] == str(a + b)
        assert "+" not in r["question"]  # the generator's phrasings all write the expression
    assert any("has" in r["question"] for r in rows)  # word problems among them


def test_three_digit_sums_are_labelled_by_their_sum():
    rows = transfer_check.three_digit(50, 0)
    for r in rows:
        a, b = (int(x) for x in re.findall(r"\d+", r["question"]))
        assert 100 <= a <= 999 and 100 <= b <= 999 and r["answer"] == str(a + b)
