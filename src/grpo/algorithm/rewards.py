"""Reward functions: pure, one signature, registered by name in ``REWARDS`` (``train.rewards``).

Every reward has the signature ``reward(completions: list[str], answers: list[str]) -> list[float]``
with one float per completion. ``answers`` are the reference final answers as text.

Model output is data. Nothing here evaluates it: numbers are read with linear-time regular
expressions and compared as exact rationals (``fractions.Fraction``) built from digit strings of
bounded length, so a 1 MB completion or ``9**9**9**9`` is scored in bounded time.

Answer extraction (``extract_answer``) picks, in order of precedence, the last
``#### N`` marker, the last ``\\boxed{N}``, the last "answer is N", and otherwise the last number
in the text. After a marker it takes the first number, or the number after the last ``=`` when
the marked text is an equation (``#### 3 + 2 = 5`` -> ``5``). The number is normalised: thousands separators, currency and unit signs dropped,
``18.00 -> 18``, ``-3``, ``1/2 -> 0.5``, ``\\frac{1}{3} -> 1/3`` (terminating decimals are written
as decimals, other fractions as ``p/q`` in lowest terms).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from fractions import Fraction

from grpo.core.registry import Registry

RewardFn = Callable[[list[str], list[str]], list[float]]

REWARDS: Registry[RewardFn] = Registry("train.rewards", "reward")
"""Reward name -> function; ``train.rewards`` weights any of them."""

MAX_DIGITS = 40  # longer digit strings are not answers (and would make big-int work unbounded)

# A number: optional sign/currency, digits with optional thousands commas, decimals, "/denominator".
# The look-behind stops a match from starting inside a word or another number, so scanning is linear.
_NUM_RE = re.compile(
    r"(?<![\w.])(?:-\$?|\$-?|−)?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s?/\s?\d+(?:\.\d+)?)?(?!\d)"
)
_FRAC_RE = re.compile(r"\\d?frac\{\s*(-?\d+)\s*\}\{\s*(-?\d+)\s*\}")
_HASH_RE = re.compile(r"####\s*([^\n]*)")
_BOXED_RE = re.compile(r"\\boxed\{([^{}\n]*(?:\{[^{}\n]*\}[^{}\n]*)*)\}")
_ANSWER_IS_RE = re.compile(r"answer\s*(?:is|:|=)\s*:?\s*([^\n]*)", re.IGNORECASE)
_STRICT_RE = re.compile(r"(?:^|\n)####[ \t]*(?:-|−)?\$?[ \t]*[\d,]+(?:\.\d+)?(?:/\d+)?[ \t]*\.?[ \t]*\Z")


def _to_fraction(token: str) -> Fraction | None:
    """Parse one number token (as matched by ``_NUM_RE``) into an exact rational."""
    t = token.replace("−", "-").replace("$", "").replace(",", "").replace(" ", "")
    num, _, den = t.partition("/")
    if max(len(num), len(den)) > MAX_DIGITS + 2:  # sign and decimal point
        return None
    try:
        value = Fraction(num)
        if den:
            d = Fraction(den)
            if d == 0:
                return None
            value /= d
    except (ValueError, ZeroDivisionError):
        return None
    return value


def format_number(value: Fraction) -> str:
    """Canonical text of a rational: ``18``, ``-3``, ``0.5``, ``1/3``."""
    if value.denominator == 1:
        return str(value.numerator)
    den = value.denominator
    for p in (2, 5):
        while den % p == 0:
            den //= p
    if den == 1:  # terminating decimal
        text = f"{value.numerator / value.denominator:.12f}".rstrip("0").rstrip(".")
        if Fraction(text) == value:
            return text
    return f"{value.numerator}/{value.denominator}"


def _number(text: str, last: bool) -> str | None:
    """The first (or last) number of ``text``, normalised; ``\\frac{a}{b}`` counts as ``a/b``."""
    text = _FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)
    found = _last_match(_NUM_RE, text) if last else _NUM_RE.search(text)
    if found is None:
        return None
    value = _to_fraction(found.group(0))
    return None if value is None else format_number(value)


def numbers_in(text: str) -> list[str]:
    """Every number of ``text`` in order, normalised as ``extract_answer``'s (``\\frac{a}{b}`` as ``a/b``;
    a token too long to be a number is left out)."""
    text = _FRAC_RE.sub(lambda m: f"{m.group(1)}/{m.group(2)}", text)
    values = (_to_fraction(m.group(0)) for m in _NUM_RE.finditer(text))
    return [format_number(v) for v in values if v is not None]


def _marked_number(segment: str) -> str | None:
    """The number a marker points at: after the last '=' when the marked text is an equation
    (``#### 3 + 2 = 5`` -> 5), else the first number (``#### 18 apples`` -> 18)."""
    _, eq, rhs = segment.rpartition("=")
    return _number(rhs if eq else segment, last=False)


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    last = None
    for m in pattern.finditer(text):
        last = m
    return last


def extract_answer(text: str) -> str | None:
    """The final numeric answer of ``text``, normalised, or ``None`` when there is none.

    Precedence: last ``#### N``, last ``\\boxed{N}``, last "answer is N", last number.
    """
    if not isinstance(text, str) or not text:
        return None
    marked = _marked_answer(text)
    return marked if marked is not None else _number(text, last=True)


def _marked_answer(text: str) -> str | None:
    """The answer behind the highest-precedence marker that has a number, else ``None``."""
    for pattern in (_HASH_RE, _BOXED_RE, _ANSWER_IS_RE):
        m = _last_match(pattern, text)
        if m is not None:
            found = _marked_number(m.group(1))
            if found is not None:
                return found
    return None


def normalize_answer(answer: str) -> str | None:
    """Reference answers go through the same normalisation (``"1,000" -> "1000"``)."""
    return extract_answer(str(answer))


@REWARDS.register("correctness")
def correctness(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the extracted final answer equals the reference answer, else 0.0."""
    out = []
    for completion, answer in zip(completions, answers, strict=True):
        got, want = extract_answer(completion), normalize_answer(answer)
        out.append(1.0 if got is not None and got == want else 0.0)
    return out


@REWARDS.register("format_strict")
def format_strict(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion has exactly one ``####`` and ends with the line ``#### <number>``."""
    return [
        1.0 if c.count("####") == 1 and _STRICT_RE.search(c.rstrip()) else 0.0
        for c in completions
    ]


@REWARDS.register("format_soft")
def format_soft(completions: list[str], answers: list[str]) -> list[float]:
    """1.0 when the completion marks a numeric answer anywhere (``####``, ``\\boxed{}``, "answer is")."""
    return [1.0 if _marked_answer(c) is not None else 0.0 for c in completions]


def combined_rewards(
    completions: list[str], answers: list[str], weights: dict[str, float]
) -> tuple[list[float], dict[str, list[float]]]:
    """Weighted sum of the named rewards, plus each reward's own values (for logging)."""
    per_fn = {name: REWARDS[name](completions, answers) for name in weights}
    total = [sum(weights[n] * per_fn[n][i] for n in weights) for i in range(len(completions))]
    return total, per_fn
