"""Arithmetic problems whose labels the project computes itself.

An expression is a flat chain ``a op b op c ...`` of non-negative integer operands and the
operators ``+ - * /`` (no parentheses, no negation). Its value follows the usual precedence:
``*`` and ``/`` bind before ``+`` and ``-``, each level from left to right, and ``/`` is exact
integer division (an expression whose quotient is not an integer has no value here). The
evaluator walks the parsed operands and operators; no text is ever passed to ``eval``.

Why not reasoning-gym's ``basic_arithmetic``: with ``allow_parentheses=False`` it folds the
operators left to right (``88 + 94 * 83`` labelled 15106, not 7890) and, for ``/``, replaces the
divisor after writing it into the question (``5 / 9`` labelled 10); it can also divide by zero.

``generate`` draws expressions from a seeded stream, item ``i`` from its own
``random.Random(f"{seed}:{i}")`` so that one item never shifts another. Every operand draws its
digit count ``d`` in ``[min_digits, max_digits]`` and then a value with exactly ``d`` digits (0 to
9 for one digit). A ``/`` takes a divisor in the operand range that divides the running product
exactly (the largest such divisor is not preferred: one is drawn uniformly among them); an item
with no such divisor is drawn again from its own stream.
"""

from __future__ import annotations

import random
import re
from collections.abc import Iterator
from dataclasses import dataclass

OPERATORS = ("+", "-", "*", "/")
TEMPLATES = ("What is {}?", "Compute {}.", "Calculate {}.", "Evaluate {}.")
"""The phrasings of a generated question; ``{}`` is the expression with single spaces."""

_TOKEN = re.compile(r"\s*(\d+|[-+*/])")
_EXPRESSION = re.compile(r"\d+(?:\s*[-+*/]\s*\d+)+")
_REDRAWS = 100


class ExpressionError(ValueError):
    """Text that is not a flat integer expression, or a division that is not exact."""


@dataclass(frozen=True)
class Expression:
    """``operands[0] operators[0] operands[1] ...``; ``len(operators) == len(operands) - 1``."""

    operands: tuple[int, ...]
    operators: tuple[str, ...]

    @property
    def text(self) -> str:
        parts = [str(self.operands[0])]
        for op, b in zip(self.operators, self.operands[1:]):
            parts += [op, str(b)]
        return " ".join(parts)

    @property
    def operand_set(self) -> tuple[int, ...]:
        """The operands as a multiset (sorted): what a held-out split keeps apart."""
        return tuple(sorted(self.operands))


def parse(text: str) -> Expression:
    """The expression in ``text`` (``"88 + 94 * 83"``); ``ExpressionError`` on anything else."""
    tokens, pos = [], 0
    text = text.strip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise ExpressionError(f"not an integer expression at {text[pos:pos + 10]!r}")
        tokens.append(m.group(1))
        pos = m.end()
    operands, operators = tokens[0::2], tokens[1::2]
    if not operands or not all(t.isdigit() for t in operands) or any(t.isdigit() for t in operators) \
            or len(operators) != len(operands) - 1:
        raise ExpressionError(f"{text!r}: operands and operators do not alternate")
    return Expression(tuple(int(t) for t in operands), tuple(operators))


def evaluate(expr: Expression) -> int:
    """The value of ``expr`` under the usual precedence.

    Algorithm: fold each run of ``*`` and ``/`` into one term (left to right), then add the terms
    with the signs of the ``+`` and ``-`` before them. Operands are non-negative, so every term is
    too and exact division is ``term % b == 0`` with ``b > 0``.
    """
    terms, signs = [expr.operands[0]], [1]
    for op, b in zip(expr.operators, expr.operands[1:]):
        if op == "*":
            terms[-1] *= b
        elif op == "/":
            if b == 0 or terms[-1] % b:
                raise ExpressionError(f"{expr.text}: {terms[-1]} / {b} is not an exact integer division")
            terms[-1] //= b
        elif op in ("+", "-"):
            terms.append(b)
            signs.append(1 if op == "+" else -1)
        else:
            raise ExpressionError(f"{expr.text}: unknown operator {op!r}")
    return sum(s * t for s, t in zip(signs, terms))


def expression_in(question: str) -> Expression:
    """The one expression written in ``question`` (``"What is 3 + 2 * 3?"`` -> ``3 + 2 * 3``)."""
    found = _EXPRESSION.findall(question)
    if len(found) != 1:
        raise ExpressionError(f"{question!r}: {len(found)} expressions, expected one")
    return parse(found[0])


def check_label(question: str, answer: str) -> None:
    """Raise ``ExpressionError`` unless ``answer`` is the value of the expression in ``question``:
    the label is recomputed from the question's text, not from how the row was made."""
    value = evaluate(expression_in(question))
    if answer != str(value):
        raise ExpressionError(f"{question!r}: labelled {answer}, the expression's value is {value}")


def _operand(rng: random.Random, min_digits: int, max_digits: int) -> int:
    d = rng.randint(min_digits, max_digits)
    return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)


def _in_range(b: int, min_digits: int, max_digits: int) -> bool:
    return (0 if min_digits == 1 else 10 ** (min_digits - 1)) <= b < 10**max_digits


def _draw(rng: random.Random, terms: int, min_digits: int, max_digits: int,
          operators: tuple[str, ...]) -> Expression | None:
    """One expression, or None when a ``/`` finds no exact divisor in the operand range."""
    ops = tuple(rng.choice(operators) for _ in range(terms - 1))
    operands = [_operand(rng, min_digits, max_digits)]
    running = operands[0]  # the value of the current run of * and /
    for op in ops:
        if op == "/":
            divisors = [b for b in range(1, min(running, 10**max_digits - 1) + 1)
                        if running % b == 0 and _in_range(b, min_digits, max_digits)] if running else \
                [b for b in range(1, 10**max_digits) if _in_range(b, min_digits, max_digits)]
            if not divisors:
                return None
            b = rng.choice(divisors)
            running //= b
        else:
            b = _operand(rng, min_digits, max_digits)
            running = running * b if op == "*" else b
        operands.append(b)
    return Expression(tuple(operands), ops)


def generate(seed: int, *, min_terms: int, max_terms: int, min_digits: int, max_digits: int,
             operators: tuple[str, ...]) -> Iterator[tuple[str, str, Expression]]:
    """An endless stream of ``(question, answer, expression)``, item ``i`` seeded by ``(seed, i)``.
    Raises ``ExpressionError`` naming ``data.operators`` when an item finds no exact division in
    ``_REDRAWS`` draws (``/`` with operands that cannot divide, e.g. two digits or more and a
    running value that is prime)."""
    bad = sorted(set(operators) - set(OPERATORS))
    if bad or not operators:
        raise ExpressionError(f"data.operators: {bad or 'none'}; choose from {' '.join(OPERATORS)}")
    i = 0
    while True:
        rng = random.Random(f"{seed}:{i}")
        for _ in range(_REDRAWS):
            expr = _draw(rng, rng.randint(min_terms, max_terms), min_digits, max_digits, tuple(operators))
            if expr is not None:
                break
        else:
            raise ExpressionError(f"data.operators: '/' found no exact divisor with {min_digits}-{max_digits} "
                                  f"digit operands in {_REDRAWS} draws; drop '/' or allow fewer digits")
        question = rng.choice(TEMPLATES).format(expr.text)
        yield question, str(evaluate(expr)), expr
        i += 1
