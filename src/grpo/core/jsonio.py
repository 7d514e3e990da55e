"""JSON and JSONL files of the stages: validated reads of problem rows, atomic writes.

``write_json`` / ``write_jsonl`` write to a temporary file and rename it, so a crash never leaves
a half-written file under the final name. ``read_jsonl`` reads problem rows and fails with a
``DataError`` naming the file and line; ``text_lines`` is the one reader of a data file's lines
(bytes that are not UTF-8 are such an error too).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path


class DataError(ValueError):
    """Bad or missing data; the message names the file or field."""


def text_lines(path: str | Path) -> Iterator[tuple[int, str]]:
    """``(line number, text)`` of each non-blank line of the UTF-8 file ``path`` (numbered from 1,
    blank lines counted). A line that is not UTF-8 raises ``DataError`` naming the file, the line
    and the first bad byte."""
    with open(path, "rb") as fh:
        for lineno, raw in enumerate(fh, 1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as err:
                raise DataError(f"{path}:{lineno}: not UTF-8 text (byte 0x{raw[err.start]:02x} at byte {err.start + 1} "
                                "of the line); save the file as UTF-8") from None
            if line.strip():
                yield lineno, line


def read_jsonl(path: str | Path) -> list[dict]:
    """Rows of a JSONL file; each must have ``question`` and ``answer``."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"{path}: data file not found")
    rows = []
    for lineno, line in text_lines(path):
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


def write_json(path: str | Path, obj, *, sort_keys: bool = False) -> None:
    """Write ``obj`` as indented JSON atomically (the metrics and summaries of every stage)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(json.dumps(obj, indent=2, sort_keys=sort_keys) + "\n")
    tmp.replace(path)
