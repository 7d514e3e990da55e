"""Rewards and answer extraction on real-looking completions, right, wrong and malformed."""

from __future__ import annotations

import math
import time
from fractions import Fraction

import pytest

from grpo.algorithm.rewards import (
    REWARDS,
    combined_rewards,
    correctness,
    extract_answer,
    format_number,
    format_soft,
    format_strict,
    normalize_answer,
)
from grpo.config.sections.train import TrainConfig

# (completion, expected extract_answer)
EXTRACTION_CASES = [
    ("Janet has 16 eggs, eats 3 and bakes 4, so 16 - 3 - 4 = 9 eggs left.\n#### 9", "9"),
    ("The total is 1,000 dollars.\n#### 1,000", "1000"),
    ("#### 1,234,567", "1234567"),
    ("So the final answer is \\boxed{18}.", "18"),
    ("The answer is $18.00.", "18"),
    ("The answer is: 42", "42"),
    ("answer = 7", "7"),
    ("He loses 5 points, ending at -3.\n#### -3", "-3"),
    ("The temperature drops to −4 degrees. #### −4", "-4"),
    ("Each gets 1/2 of the pie.\n#### 1/2", "0.5"),
    ("Each gets \\frac{1}{3} of the cake, so \\boxed{\\frac{1}{3}}", "1/3"),
    ("\\boxed{\\dfrac{3}{4}}", "0.75"),
    ("She pays $12.50 in total.\n#### $12.50", "12.5"),
    ("The answer is 0.25", "0.25"),
    ("First I guessed 10 but that is wrong. The answer is 12.", "12"),
    ("#### 5\nWait, let me recheck.\n#### 6", "6"),
    ("\\boxed{3} ... actually \\boxed{4}", "4"),
    ("The answer is 8. #### 9", "9"),  # the marked #### answer wins over 'answer is'
    ("I think 3 + 4 = 7", "7"),  # no marker: the last number
    ("3 apples plus 4 apples make 7 apples in total.", "7"),
    ("There are 2,500 people and 300 leave, so 2,200 remain.", "2200"),
    ("The result is 12.", "12"),
    ("2 + 3 = 5.", "5"),
    ("Total: 100%", "100"),
    ("#### 007", "7"),
    ("#### 3.000", "3"),
    ("#### 2.50", "2.5"),
    ("x = 10/4", "2.5"),
    ("The ratio is 2/3", "2/3"),
    ("#### 1/0", None),  # division by zero is no answer; there is no other number
    ("I don't know.", None),
    ("", None),
    ("####", None),
    ("#### banana", None),
    ("The answer is \\boxed{}", None),
    ("9**9**9**9", "9"),  # never evaluated
    ("__import__('os').system('rm -rf /')", None),
    ("The answer is " + "9" * 100, None),  # absurdly long numbers are not answers
    ("step2: we add, so answer3 is not a number but 4 is", "4"),
    ("Version 1.2.3 says 5", "5"),
    ("#### -0", "0"),
    ("Answer is -$5", "-5"),
    ("#### 3 + 2 = 5", "5"),  # a marked equation: its result
    ("The answer is 2 + 7 = 9.", "9"),
    ("\\boxed{4 \\times 3 = 12}", "12"),
]


@pytest.mark.parametrize(("completion", "expected"), EXTRACTION_CASES)
def test_extract_answer(completion, expected):
    assert extract_answer(completion) == expected


@pytest.mark.parametrize(("completion", "expected"), EXTRACTION_CASES)
def test_extraction_ignores_surrounding_whitespace(completion, expected):
    assert extract_answer(f" \n\t{completion}\n  \n") == expected


@pytest.mark.parametrize("expected", sorted({e for _, e in EXTRACTION_CASES if e is not None}))
def test_extracted_answers_are_canonical(expected):
    # the normalised text reads back as itself, so references and completions meet in one form
    assert extract_answer(expected) == expected
    assert normalize_answer(expected) == expected


@pytest.mark.parametrize("n", [0, 7, 999, 1000, 12345, 1234567, -4500, 10**12 + 3])
@pytest.mark.parametrize("template", ["#### {}", "The answer is {}.", "so \\boxed{{{}}}", "We get {} in total."])
def test_thousands_separators_are_dropped(n, template):
    assert extract_answer(template.format(f"{n:,}")) == extract_answer(template.format(n)) == str(n)


@pytest.mark.parametrize("value", [Fraction(18), Fraction(-3), Fraction(1, 2), Fraction(1, 3), Fraction(-5, 4),
                                   Fraction(7, 8), Fraction(22, 7), Fraction(10**15 + 1, 4)])
def test_format_number_round_trips(value):
    text = format_number(value)
    assert Fraction(text) == value
    assert extract_answer(f"#### {text}") == text


# Spellings of one value; every pair must agree, whichever side is the completion.
EQUIVALENT = {
    "1000": ["1000", "1,000", "1000.00", "$1,000", "1,000.0"],
    "0.5": ["0.5", "1/2", "\\frac{1}{2}", "0.50", "2/4"],
    "-3": ["-3", "-3.0", "−3", "-$3"],
}


@pytest.mark.parametrize(("a", "b"), [(a, b) for forms in EQUIVALENT.values() for a in forms for b in forms])
def test_correctness_is_symmetric_in_answer_formatting(a, b):
    assert correctness([f"#### {a}"], [b]) == correctness([f"#### {b}"], [a]) == [1.0]


@pytest.mark.parametrize(("a", "b"), [("1000", "100"), ("1,000", "10,000"), ("0.5", "5"), ("1/2", "2"), ("-3", "3")])
def test_correctness_separates_different_values(a, b):
    assert correctness([f"#### {a}"], [b]) == correctness([f"#### {b}"], [a]) == [0.0]


def test_no_answer_never_matches_an_unreadable_reference():
    # both sides extract to None; that is not a match
    assert correctness(["I don't know.", ""], ["banana", "n/a"]) == [0.0, 0.0]


CORRECTNESS_CASES = [
    ("Janet sells 9 eggs at $2 each: 9 * 2 = 18.\n#### 18", "18", 1.0),
    ("Janet sells 9 eggs at $2 each: 9 * 2 = 18.\n#### 16", "18", 0.0),
    ("So she makes \\boxed{18} dollars.", "18", 1.0),
    ("The answer is $18.00.", "18", 1.0),
    ("#### 1000", "1,000", 1.0),
    ("#### 0.5", "1/2", 1.0),
    ("#### 18 apples, wait no, 17", "17", 0.0),  # the first number after the marker counts
    ("The answer is 17.", "-17", 0.0),
    ("I cannot solve this.", "5", 0.0),
    ("", "5", 0.0),
    ("5" * 10_000, "5", 0.0),
]


@pytest.mark.parametrize(("completion", "answer", "expected"), CORRECTNESS_CASES)
def test_correctness(completion, answer, expected):
    assert correctness([completion], [answer]) == [expected]


def test_format_rewards():
    completions = [
        "3 + 4 = 7\n#### 7",  # strict and soft
        "3 + 4 = 7\n#### 7\n",  # trailing newline is fine
        "#### 7 and more text after",  # soft only: not the last line
        "#### 6\n#### 7",  # soft only: two markers
        "The answer is 7",  # soft only
        "\\boxed{7}",  # soft only
        "7",  # neither
        "#### seven",  # neither: no number
    ]
    answers = ["7"] * len(completions)
    assert format_strict(completions, answers) == [1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]
    assert format_soft(completions, answers) == [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0]


REAL_LOOKING = ["#### 7", "7 + 5 = 12", "The answer is 12.", "\\boxed{12}", "", "To solve 7 + 5, we add them: 7 + 5 = 13",
                "#### 1,000", "12\n#### 12", "-3/4", "no number at all"]


@pytest.mark.parametrize("name", sorted(REWARDS))
def test_every_registered_reward_keeps_the_contract(name):
    """What every reward must do, so that a new one is tested by registering it: one finite float
    per completion, the same scores for the same inputs (pure), the params accept its name, and a
    weight scales it in ``combined_rewards``."""
    fn = REWARDS[name]
    answers = ["12"] * len(REAL_LOOKING)
    scores = fn(REAL_LOOKING, answers)
    assert isinstance(scores, list) and len(scores) == len(REAL_LOOKING)
    assert all(isinstance(s, float) and math.isfinite(s) for s in scores), scores
    assert fn(list(REAL_LOOKING), list(answers)) == scores
    assert fn([], []) == []
    total, per_fn = combined_rewards(REAL_LOOKING, answers, {name: 2.0})
    assert total == [2.0 * s for s in per_fn[name]] and per_fn[name] == scores
    TrainConfig(rewards={name: 1.0})  # the params accept it at once (validated through the registry)


def test_registry_and_weights():
    assert {"correctness", "format_strict", "format_soft"} <= set(REWARDS)  # the shipped ones; more may join
    completions = ["#### 7", "7", "#### 8"]
    total, per_fn = combined_rewards(completions, ["7"] * 3, {"correctness": 1.0, "format_soft": 0.5})
    assert per_fn["correctness"] == [1.0, 1.0, 0.0]
    assert per_fn["format_soft"] == [1.0, 0.0, 1.0]
    assert total == [1.5, 1.0, 0.5]


@pytest.mark.parametrize(
    "hostile",
    [
        "1 " * 500_000,  # 1 MB of numbers
        "a" * 1_000_000,  # 1 MB without numbers
        "\\boxed{" * 150_000,  # unbalanced braces
        "#### " * 200_000,  # a marker storm
        "9" * 1_000_000,  # one enormous number
        "9**9**9**9" * 100_000,
    ],
)
def test_hostile_completions_are_scored_in_bounded_time(hostile):
    start = time.perf_counter()
    for fn in REWARDS.values():
        assert math.isfinite(fn([hostile], ["9"])[0])
    assert time.perf_counter() - start < 10.0  # bounded (linear); typically well under a second
