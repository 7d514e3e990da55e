"""The stages' JSON files (``grpo.core.jsonio``): problem rows read back with a ``DataError`` naming the file and
line of a bad one; writes that never leave a half-written file under the final name."""

from __future__ import annotations

import json

import pytest

from grpo.core.jsonio import DataError, read_jsonl, write_json, write_jsonl

ROWS = [{"question": "What is 2 + 2?", "answer": "4", "id": "p0"}, {"question": "Deux fois trois ?", "answer": 6}]


def test_rows_round_trip_one_sorted_line_each(tmp_path):
    """``write_jsonl`` makes the parent folders and writes one line per row, keys sorted, non-ASCII
    as it is; ``read_jsonl`` gives the rows back, blank lines skipped; no ``.part`` file is left."""
    path = tmp_path / "a" / "b" / "rows.jsonl"
    rows = [*ROWS, {"question": "Combien font 5 € + 3 € ?", "answer": "8"}]
    write_jsonl(path, rows)
    lines = path.read_text(encoding="utf-8").splitlines()
    assert lines[0] == '{"answer": "4", "id": "p0", "question": "What is 2 + 2?"}'
    assert "5 € + 3 €" in lines[2]
    assert read_jsonl(path) == rows
    path.write_text(path.read_text() + "\n   \n")
    assert read_jsonl(path) == rows
    assert [p.name for p in path.parent.iterdir()] == ["rows.jsonl"]


@pytest.mark.parametrize(("content", "message"), [
    ('{"question": "q", "answer": "1"}\n{"question": "q2"\n', r"rows\.jsonl:2: not valid JSON"),
    ('{"question": "q", "answer": "1"}\n\n{"question": "q2"}\n', r"rows\.jsonl:3: a row needs 'question' and 'answer'"),
    ('["q", "1"]\n', r"rows\.jsonl:1: a row needs 'question' and 'answer'"),
    ("\n\n", r"rows\.jsonl: no rows"),
])
def test_a_bad_file_fails_naming_the_file_and_line(tmp_path, content, message):
    path = tmp_path / "rows.jsonl"
    path.write_text(content)
    with pytest.raises(DataError, match=message):
        read_jsonl(path)


def test_bytes_that_are_not_utf8_fail_naming_the_file_line_and_byte(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_bytes(b'{"question": "q", "answer": "1"}\n\n{"question": "\xe9t\xe9", "answer": "2"}\n')
    with pytest.raises(DataError) as err:
        read_jsonl(path)
    assert str(err.value) == f"{path}:3: not UTF-8 text (byte 0xe9 at byte 15 of the line); save the file as UTF-8"


def test_a_missing_file_fails_naming_it(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: data file not found"):
        read_jsonl(tmp_path / "nope.jsonl")
    assert issubclass(DataError, ValueError)


def test_write_json_is_indented_and_ends_with_a_newline(tmp_path):
    path = tmp_path / "m" / "metrics.json"
    write_json(path, {"b": 1, "a": [1, 2]})
    assert path.read_text() == '{\n  "b": 1,\n  "a": [\n    1,\n    2\n  ]\n}\n'
    write_json(path, {"b": 1, "a": 2}, sort_keys=True)
    assert path.read_text() == '{\n  "a": 2,\n  "b": 1\n}\n' and json.loads(path.read_text()) == {"a": 2, "b": 1}


def test_a_failed_write_leaves_the_previous_file_whole(tmp_path):
    """A write that fails part-way (a row that is not JSON) leaves the file under the final name as
    it was before, for both writers."""
    rows_path, json_path = tmp_path / "rows.jsonl", tmp_path / "summary.json"
    write_jsonl(rows_path, ROWS)
    write_json(json_path, {"ok": True})
    before = rows_path.read_text(), json_path.read_text()
    with pytest.raises(TypeError):
        write_jsonl(rows_path, [*ROWS, {"question": "q", "answer": object()}])
    with pytest.raises(TypeError):
        write_json(json_path, {"ok": object()})
    assert (rows_path.read_text(), json_path.read_text()) == before
    assert read_jsonl(rows_path) == ROWS
