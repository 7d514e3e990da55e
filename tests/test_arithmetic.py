"""Generated arithmetic: the evaluator's precedence and exact division, labels checked against the
question's own text, and splits held out by operand multiset."""

import ast
from fractions import Fraction

import pytest

from grpo.config.sections.data_section import DataConfig
from grpo.core.jsonio import DataError
from grpo.data import arithmetic
from grpo.data.arithmetic import Expression, ExpressionError, check_label, evaluate, expression_in, parse
from grpo.data.sources import generate_arithmetic, operand_sets_shared, prepare_splits, split_of


@pytest.mark.parametrize(("question", "value"), [
    ("Solve 88 + 94 * 83.", 7890),       # reasoning-gym 0.1.25 labels it 15106 (left to right)
    ("What is 3 + 2 * 3?", 9),           # ... 15
    ("What is 8 - 6 / 2 * 4?", -4),      # * and / left to right, before -
    ("Compute 7 - 2 - 3.", 2),           # - is left-associative
    ("Evaluate 12 / 4 / 3.", 1),
    ("What is 0 * 9 + 5?", 5),
])
def test_evaluator_follows_the_usual_precedence(question, value):
    assert evaluate(expression_in(question)) == value


@pytest.mark.parametrize("question", ["What is 5 / 9?", "Solve 13 / 92.", "What is 4 / 0?"])
def test_inexact_division_has_no_value(question):
    # reasoning-gym labels the first two 10 and 806; the third raises ZeroDivisionError there
    with pytest.raises(ExpressionError, match="not an exact integer division"):
        evaluate(expression_in(question))


def test_check_label_recomputes_from_the_text():
    check_label("Solve 88 + 94 * 83.", "7890")
    with pytest.raises(ExpressionError, match="labelled 15106, the expression's value is 7890"):
        check_label("Solve 88 + 94 * 83.", "15106")


@pytest.mark.parametrize("text", ["3 +", "+ 3", "3 4", "3 ** 4", "3 + x", ""])
def test_parse_refuses_what_is_not_a_flat_expression(text):
    with pytest.raises(ExpressionError):
        parse(text)


def test_parse_round_trips_the_generated_text():
    e = Expression((88, 94, 83), ("+", "*"))
    assert parse(e.text) == e and e.operand_set == (83, 88, 94)


def _python_value(text: str) -> Fraction:
    """An oracle apart from ``grpo.data.arithmetic``: Python's own parser decides the precedence, exact
    fractions the values (the AST is walked; nothing is passed to ``eval``)."""
    ops = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b,
           ast.Div: lambda a, b: a / b}

    def walk(node):
        if isinstance(node, ast.BinOp):
            return ops[type(node.op)](walk(node.left), walk(node.right))
        return Fraction(node.value)

    return walk(ast.parse(text, mode="eval").body)


OPERATOR_SETS = [("+",), ("+", "-"), ("+", "*"), ("+", "-", "*"), ("*", "/"), ("+", "-", "*", "/")]


@pytest.mark.parametrize("operators", OPERATOR_SETS)
def test_ten_thousand_generated_labels_agree_with_their_expressions(operators):
    rows = generate_arithmetic(10_000, 3, min_terms=2, max_terms=3, min_digits=1, max_digits=2, operators=operators)
    wrong = 0
    for row in rows:
        try:
            check_label(row["question"], row["answer"])
        except ExpressionError:
            wrong += 1
        assert Fraction(int(row["answer"])) == _python_value(expression_in(row["question"]).text)
    assert len(rows) == 10_000 and wrong == 0
    used = {op for row in rows for op in expression_in(row["question"]).operators}
    assert used == set(operators)  # every operator asked for is drawn, '/' included


def test_division_without_exact_divisors_is_refused_naming_the_key():
    # a / b / c with two-digit operands: a / b is at most 9, which no two-digit c divides
    stream = arithmetic.generate(0, min_terms=3, max_terms=3, min_digits=2, max_digits=2, operators=("/",))
    with pytest.raises(ExpressionError, match="data.operators"):
        next(stream)


@pytest.mark.parametrize("kw", [dict(), dict(max_digits=2, operators=["+", "-"]),
                                dict(min_terms=3, max_terms=3, operators=["+", "-", "*"])])
def test_splits_share_no_operand_set(kw):
    train, test, val, stats = prepare_splits(DataConfig(source="arithmetic", **kw))
    assert train and test and val
    assert operand_sets_shared(train, test, val) == {"train_test": 0, "train_val": 0, "test_val": 0}
    for name, rows in (("train", train), ("test", test), ("val", val)):
        assert all(split_of(expression_in(r["question"]).operand_set, 0) == name for r in rows)


def test_operand_overlap_is_counted_from_the_text():
    a = [{"question": "What is 3 + 4?"}]
    b = [{"question": "Compute 4 + 3."}]  # the same multiset in other words
    c = [{"question": "What is 3 + 5?"}]
    assert operand_sets_shared(a, b, c) == {"train_test": 1, "train_val": 0, "test_val": 0}


def test_a_wrong_label_stops_the_stage(monkeypatch):
    real = arithmetic.evaluate
    monkeypatch.setattr(arithmetic, "evaluate", lambda e: real(e) + (1 if len(e.operands) == 3 else 0))
    # the generator's labels now disagree with the text for 3-term rows; prepare_splits must refuse
    monkeypatch.setattr(arithmetic, "check_label", _independent_check)
    with pytest.raises(DataError, match="labelled"):
        prepare_splits(DataConfig(source="arithmetic", min_terms=3, max_terms=3, max_digits=2))


def _independent_check(question: str, answer: str) -> None:
    """check_label with its own evaluation (left as written: the patched evaluate is the generator's)."""
    e = expression_in(question)
    terms, signs = [e.operands[0]], [1]
    for op, b in zip(e.operators, e.operands[1:]):
        if op in "+-":
            terms.append(b)
            signs.append(1 if op == "+" else -1)
        else:
            terms[-1] = terms[-1] * b if op == "*" else terms[-1] // b
    value = sum(s * t for s, t in zip(signs, terms))
    if answer != str(value):
        raise ExpressionError(f"{question!r}: labelled {answer}, the expression's value is {value}")
