"""The failure classes and operand-digit groups of evaluated answers (``grpo.data.answers``), on
completions of the kind the base and the trained SmolLM2 write."""

from __future__ import annotations

import pytest

from grpo.algorithm.rewards import correctness
from grpo.data.answers import (
    CLASSES,
    accuracy_by_digits,
    class_counts,
    cluster_key,
    digit_group,
    examples_by_class,
    failure_class,
)


@pytest.mark.parametrize(("question", "answer", "completion", "expected"), [
    ("Compute 5 + 1.", "6", "5 + 1 = 6", "correct"),
    ("What is 25 + 8?", "33", "25 + 8 = 33\n#### 33", "correct"),
    ("Compute 2 + 2.", "4", "To compute two plus two, we simply add them together.", "no_number"),
    ("Compute 5 + 1.", "6", "To solve 5 + 1, we need to add 5 and 1. This is equivalent to adding 1 and 5.",
     "operand"),
    ("Calculate 8 + 79.", "87", "The answer is 79.", "operand"),
    ("Compute 25 + 8.", "33", "To compute 25 + 8, we need to add 8 and 2. This is done by adding 2 and 2, "
     "which is 4. So, we have 4 added to 2, which is 8. Now, we add 4 to 8, which is", "operand"),
    ("What is 12 + 7?", "19", "12 + 7 = 19. Adding one more for the carry gives 20.", "sum_not_last"),
    ("Evaluate 34 + 58.", "92", "34 + 58 = 82", "wrong_number"),
    ("Evaluate 34 + 58.", "92", "34 + 58 = 92 - 10 = 82", "sum_not_last"),
    # the base model's own answers (the committed run's baseline evaluation, cut where it was cut)
    ("Evaluate 8 + 4.", "12", "To evaluate 8 + 4, we need to add 8 and 4. 8 + 4 is 12, and 12 is 14. So, we can "
     "add these numbers together. 14 + 14 = 18, and 14 + ", "sum_not_last"),
    ("Compute 2 + 2.", "4", "To solve 2 + 2, we need to add 2 and 2. This is done by adding 2 and 2, which is 2. "
     "So, we add 2 and 2, which is 2. So, we get 2. So, we add 2 and ", "operand"),
    ("Compute 25 + 8.", "33", "To compute 25 + 8, we need to add 2 + 8 = 10. So, we can add 10 to 2 and 8, which "
     "gives us 10 + 8 = 18. Now, we can add 18 to 2 and", "wrong_number"),  # 2: a digit of 25, not an operand
    ("Calculate 8 + 79.", "87", "To calculate 8 + 79, we need to add 8 and 7. We can do this by adding 8 and 7 "
     "using the number 8. We add 8 and 7, which is 10. Then we add 10, which is 10. Finally", "wrong_number"),
    # the trained model's: the value equals an operand, so restating the expression writes it
    ("Compute 0 + 97.", "97", "0 + 97 = 98", "sum_not_last"),
    ("What is 88 + 2?", "90", "88 + 2 = 88", "operand"),
    # the value equals an operand (0 + 7): a final 7 is right, not an operand
    ("What is 0 + 7?", "7", "0 + 7 = 7", "correct"),
    # a word problem has no operands: a wrong final number is wrong, whatever it is
    ("Tom has 3 apples and buys 4 more. How many now?", "7", "He has 3 apples.", "wrong_number"),
])
def test_each_class_on_real_looking_completions(question, answer, completion, expected):
    assert failure_class(question, answer, completion) == expected


def test_correct_is_exactly_the_rewards_correctness():
    rows = [("Compute 5 + 1.", "6", "5 + 1 = 6"), ("Compute 5 + 1.", "6", "5 + 1 = 7"),
            ("Compute 5 + 1.", "6", "#### 6.0"), ("Compute 5 + 1.", "6", "6 apples, so 5")]
    for q, a, c in rows:
        assert (failure_class(q, a, c) == "correct") == (correctness([c], [a])[0] == 1.0)


def test_the_value_appearing_is_tested_before_the_operand_class():
    """12 + 7 answered 12 after writing 19: the right value was written, not last (the earlier test
    wins); answered 12 without writing 19: an operand."""
    assert failure_class("What is 12 + 7?", "19", "12 + 7 = 19, so the answer is 12") == "sum_not_last"
    assert failure_class("What is 12 + 7?", "19", "12 + 7 is 12") == "operand"


def test_digit_groups_and_clusters_read_the_expression_back():
    assert [digit_group(q) for q in ("Compute 5 + 1.", "What is 25 + 8?", "Calculate 8 + 79.", "What is 34 + 58?",
                                     "What is 3 + 40 + 500?", "How many apples?")] == \
        ["1 & 1", "1 & 2", "1 & 2", "2 & 2", "1 & 2 & 3", None]
    assert cluster_key("What is 12 + 7?") == cluster_key("Compute 7 + 12.") != cluster_key("Compute 7 + 13.")
    assert cluster_key("How many apples?") == "How many apples?"


def _record(question, answer, completion):
    return {"question": question, "answer": answer, "completion": completion,
            "correct": correctness([completion], [answer])[0] > 0}


def test_counts_cover_every_class_and_accuracy_is_per_digit_group():
    records = [_record("Compute 5 + 1.", "6", "5 + 1 = 6"), _record("Compute 2 + 2.", "4", "add them"),
               _record("What is 25 + 8?", "33", "25 + 8 = 34"), _record("What is 25 + 9?", "34", "25 + 9 = 34"),
               _record("What is 34 + 58?", "92", "The answer is 34")]
    counts = class_counts(records)
    assert list(counts) == list(CLASSES) and sum(counts.values()) == len(records)
    assert (counts["correct"], counts["no_number"], counts["operand"], counts["wrong_number"]) == (2, 1, 1, 1)
    by = accuracy_by_digits(records)
    assert by["1 & 1"] == {"n": 2, "correct": 1, "accuracy": 0.5}
    assert by["1 & 2"] == {"n": 2, "correct": 1, "accuracy": 0.5}
    assert by["2 & 2"] == {"n": 1, "correct": 0, "accuracy": 0.0}
    examples = examples_by_class(records, k=1)
    assert [r["completion"] for r in examples["correct"]] == ["5 + 1 = 6"] and "sum_not_last" not in examples
