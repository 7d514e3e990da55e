"""Problem rows, offline generators and prompt building.

A problem row is ``{"id", "question", "answer", "solution"}``: ``answer`` is the final number as
text, ``solution`` the worked solution when the source has one (else ``""``).
``build_prompt`` is the one place a question becomes model input; rollouts, SENT and
evaluation all call it.
"""

from __future__ import annotations

import json
from pathlib import Path


class DataError(ValueError):
    """Bad or missing data; the message names the file or field."""


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file; each must have ``question`` and ``answer``."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: data file not found")
    rows = []
    with open(path, encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from err
            if not isinstance(row, dict) or "question" not in row or "answer" not in row:
                raise DataError(f"{path}:{lineno}: a row needs 'question' and 'answer'")
            rows.append(row)
    if not rows:
        raise DataError(f"{path}: no rows")
    return rows


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write rows atomically (a crash never leaves a half-written file under ``path``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    with open(tmp, "w", encoding="utf-8") as fh:
        for row in rows:
            fh.write(json.dumps(row, ensure_ascii=False, sort_keys=True) + "\n")
    tmp.replace(path)


def generate_arithmetic(
    n: int,
    seed: int,
    *,
    min_terms: int = 2,
    max_terms: int = 2,
    min_digits: int = 1,
    max_digits: int = 1,
    operators: tuple[str, ...] = ("+",),
    prefix: str = "arith",
) -> list[dict]:
    """Easy arithmetic questions in natural phrasing from reasoning-gym's ``basic_arithmetic``."""
    import reasoning_gym

    ds = reasoning_gym.create_dataset(
        "basic_arithmetic",
        size=n,
        seed=seed,
        min_terms=min_terms,
        max_terms=max_terms,
        min_digits=min_digits,
        max_digits=max_digits,
        operators=tuple(operators),
        allow_parentheses=False,
        allow_negation=False,
        format_style="natural",
    )
    return [
        {"id": f"{prefix}-{seed}-{i}", "question": item["question"], "answer": str(item["answer"]), "solution": ""}
        for i, item in enumerate(ds)
    ]


def build_prompt(tokenizer, question: str, system_prompt: str) -> str:
    """Model input text for ``question``: the chat template when the tokenizer has one, else a
    plain ``system / Question: / Answer:`` template."""
    if getattr(tokenizer, "chat_template", None):
        messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": question}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return f"{system_prompt}\n\nQuestion: {question}\nAnswer:"
