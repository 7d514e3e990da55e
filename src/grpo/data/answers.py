"""What the evaluated answers show: each answer's failure class, accuracy by the operands' digits,
and the problem clusters (operand multisets) that an interval counts once.

Pure functions of an evaluation's per-problem records (``grpo.evaluation.evaluate.score``: ``question``,
``answer``, ``completion``); the expression is read back from the question's text
(``grpo.data.arithmetic.expression_in``), so a row that holds none (a word problem) has no operands.

Failure classes (``failure_class``), the first that holds, in this order:

1. ``correct``: the final answer (``grpo.algorithm.rewards.extract_answer``) equals the reference
   (``grpo.algorithm.rewards.correctness``'s rule).
2. ``no_number``: the completion has no final answer (no number at all).
3. ``sum_not_last``: the reference value is among the completion's numbers (``grpo.algorithm.rewards.numbers_in``)
   but is not its final answer (``12 + 7 = 19, so the answer is 20``; also ``12 + 7 = 19, so 12``).
4. ``operand``: the final answer is one of the expression's operands (``12 + 7`` answered ``12``)
   and the reference value is nowhere in the completion.
5. ``wrong_number``: any other number.

The order is the one that reproduces issue 58's count of the committed run's base model (293 wrong
numbers, 132 operands, 31 right values not last): a completion that wrote the right value and then
ended on something else is counted as the first, whatever it ended on. A value equal to an operand
(``0 + 97``) is written whenever the expression is restated, so ``0 + 97 = 98`` counts there too.

Operand digits (``digit_group``): the digit counts of the expression's operands, sorted, joined by
``" & "``: ``"1 & 1"`` (both one digit), ``"1 & 2"``, ``"2 & 2"``; an expression of three terms is
``"1 & 1 & 2"``, so every row has one group whatever its number of terms. A word problem has none.
"""

from __future__ import annotations

from collections import Counter

from grpo.algorithm.rewards import extract_answer, normalize_answer, numbers_in
from grpo.data.arithmetic import ExpressionError, expression_in

CLASSES = ("correct", "no_number", "sum_not_last", "operand", "wrong_number")
"""The failure classes in the order they are tested (``failure_class``)."""

CLASS_WORDS = {"correct": "correct", "no_number": "no number in the answer",
               "operand": "the final number is an operand", "sum_not_last": "the right value appears, not last",
               "wrong_number": "a wrong number"}


def operands_of(question: str) -> tuple[int, ...] | None:
    """The operands of the one expression in ``question`` in their order, or ``None`` (no expression)."""
    try:
        return expression_in(question).operands
    except ExpressionError:
        return None


def failure_class(question: str, answer: str, completion: str) -> str:
    """The class of ``completion`` (one of ``CLASSES``) as an answer to ``question`` whose value is
    ``answer`` (see the module docstring for the order of the tests)."""
    got, want = extract_answer(completion), normalize_answer(answer)
    if got is not None and got == want:
        return "correct"
    if got is None:
        return "no_number"
    if want in numbers_in(completion):
        return "sum_not_last"
    if got in {str(x) for x in operands_of(question) or ()}:
        return "operand"
    return "wrong_number"


def digit_group(question: str) -> str | None:
    """The sorted digit counts of the expression's operands, ``"1 & 2"``; ``None`` without one."""
    operands = operands_of(question)
    return None if operands is None else " & ".join(str(d) for d in sorted(len(str(x)) for x in operands))


def cluster_key(question: str) -> str:
    """The problem ``question`` asks, for counting a problem once: its operand multiset (``"7,12"``
    for ``"What is 12 + 7?"`` and ``"Compute 7 + 12."`` alike), or the question text when it holds
    no expression."""
    operands = operands_of(question)
    return question if operands is None else ",".join(str(x) for x in sorted(operands))


def class_counts(records: list[dict]) -> dict[str, int]:
    """``{class: count}`` over every class of ``CLASSES`` (0 included), in that order."""
    counts = Counter(failure_class(r["question"], str(r["answer"]), r["completion"]) for r in records)
    return {c: counts.get(c, 0) for c in CLASSES}


def accuracy_by_digits(records: list[dict]) -> dict[str, dict[str, float]]:
    """``{digit group: {"n", "correct", "accuracy"}}`` of the records with an expression, groups
    sorted; correctness is the record's ``correct``."""
    groups: dict[str, list[bool]] = {}
    for r in records:
        group = digit_group(r["question"])
        if group is not None:
            groups.setdefault(group, []).append(bool(r["correct"]))
    return {g: {"n": len(v), "correct": sum(v), "accuracy": sum(v) / len(v)} for g, v in sorted(groups.items())}


def examples_by_class(records: list[dict], k: int = 2) -> dict[str, list[dict]]:
    """The first ``k`` records of each class (a class without any is left out)."""
    out: dict[str, list[dict]] = {}
    for r in records:
        group = out.setdefault(failure_class(r["question"], str(r["answer"]), r["completion"]), [])
        if len(group) < k:
            group.append(r)
    return {c: out[c] for c in CLASSES if out.get(c)}
