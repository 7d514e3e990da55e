"""The prepare_data stage (``python -m tasks.prepare_data``): byte-identical outputs across runs; an
offline gsm8k source and a data file that is not UTF-8 reported in one line; a user's rejected rows
in one warning; the stage time of a run of another params file kept out of the workspace's."""

import json
import subprocess
import sys

import pytest


def test_prepare_data_stage_is_byte_identical_across_runs(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(f"data: {{source: arithmetic, train_size: 30, test_size: 20, max_digits: 2, out_dir: {tmp_path}/raw}}\n"
                      f"train: {{metrics_dir: {tmp_path}/metrics}}\n")
    outputs = []
    for _ in range(2):
        subprocess.run([sys.executable, "-m", "tasks.prepare_data", "--params", str(params)], check=True)
        outputs.append({n: (tmp_path / "raw" / n).read_bytes() for n in ("train.jsonl", "test.jsonl", "stats.json")})
    assert outputs[0] == outputs[1]
    stats = json.loads(outputs[0]["stats.json"])
    assert stats["train"] == 30 and stats["test"] + stats["test_dropped_shared_with_train"] == 20


def test_prepare_data_stage_reports_offline_gsm8k_as_one_line(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(f"data: {{source: gsm8k, out_dir: {tmp_path}/raw}}\n")
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "tasks.prepare_data", "--params", str(params)],
                          capture_output=True, text=True, env=env)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("prepare_data: error: data.source=gsm8k")
    assert not (tmp_path / "raw" / "train.jsonl").exists()


def _prepare(tmp_path, lines: list[bytes]):
    """prepare_data on a jsonl source of ``lines``: (exit code, stderr lines)."""
    (tmp_path / "mine.jsonl").write_bytes(b"\n".join(lines) + b"\n")
    params = tmp_path / "params.yaml"
    params.write_text(f"data: {{source: jsonl, path: {tmp_path}/mine.jsonl, train_size: 8, test_size: 2, val_size: 0, "
                      f"out_dir: {tmp_path}/raw}}\ntrain: {{metrics_dir: {tmp_path}/metrics}}\n")
    proc = subprocess.run([sys.executable, "-m", "tasks.prepare_data", "--params", str(params)],
                          capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr.splitlines()


def _good(i: int) -> bytes:
    return json.dumps({"question": f"What is {i} + 1?", "answer": str(i + 1)}).encode()


def test_a_data_file_that_is_not_utf8_is_one_line_naming_the_file_and_line(tmp_path):
    """A Latin-1 byte on line 3: exit 2, one line naming the file, the line and the byte; nothing written."""
    code, err = _prepare(tmp_path, [_good(0), _good(1), b'{"question": "Combien co\xfbte 2 + 2 ?", "answer": "4"}', _good(3)])
    assert code == 2
    assert err == [f"prepare_data: error: {tmp_path}/mine.jsonl:3: not UTF-8 text (byte 0xfb at byte 25 of the line); "
                   "save the file as UTF-8"]
    assert not (tmp_path / "raw").exists() and not (tmp_path / "metrics").exists()


def test_rejected_rows_are_one_warning_with_their_lines_and_reasons(tmp_path):
    """Rows without an answer, with a word for an answer, with an empty question, or that are not
    JSON: one WARNING naming the file, the count and the first three lines with their reasons; the
    valid rows are all written and stats.json counts the rejected ones."""
    bad = [b'{"question": "No answer?"}', b'{"question": "Word?", "answer": "abc"}', b'{"question": " ", "answer": "3"}',
           b"not json {"]
    code, err = _prepare(tmp_path, [_good(0), _good(1), _good(2), bad[0], *map(_good, range(3, 7)), bad[1],
                                    _good(7), _good(8), bad[2], bad[3], _good(9)])
    assert code == 0, err
    warnings = [x for x in err if " WARNING " in x]
    assert warnings == [f"[prepare_data] WARNING {tmp_path}/mine.jsonl: 4 rows skipped: line 4: no answer; line 9: "
                        "answer 'abc' is not a number; line 12: empty question; and 1 more"]
    rows = [json.loads(x) for name in ("train.jsonl", "test.jsonl")
            for x in (tmp_path / "raw" / name).read_text().splitlines()]
    assert len(rows) == 10
    assert json.loads((tmp_path / "raw" / "stats.json").read_text())["rejected_rows"] == 4


@pytest.mark.slow
def test_a_run_of_another_params_file_leaves_the_workspace_time_alone(tmp_path):
    """In a workspace (params.yaml in the current directory): a run of the workspace's params writes
    metrics/time/prepare_data.json; a run of another file writes it only under a train.metrics_dir
    of its own, never over the workspace's (an output dvc repro would see changed)."""
    import os

    from tests.conftest import REPO

    data = "data: {source: arithmetic, train_size: 6, test_size: 4, val_size: 0}\n"
    (tmp_path / "params.yaml").write_text(data)
    (tmp_path / "preset.yaml").write_text(data)
    (tmp_path / "own.yaml").write_text(data + "train: {metrics_dir: runs/own}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(*argv):
        subprocess.run([sys.executable, "-m", "tasks.prepare_data", *argv], cwd=tmp_path, env=env, check=True,
                       capture_output=True, timeout=120)

    run("--params", "preset.yaml")
    assert (tmp_path / "data" / "raw" / "train.jsonl").exists() and not (tmp_path / "metrics").exists()
    run("--params", "own.yaml")
    assert (tmp_path / "runs" / "own" / "time" / "prepare_data.json").exists() and not (tmp_path / "metrics").exists()
    run("--params", str(tmp_path / "params.yaml"))
    assert json.loads((tmp_path / "metrics" / "time" / "prepare_data.json").read_text())["seconds"] >= 0
    run()
    written = (tmp_path / "metrics" / "time" / "prepare_data.json").read_text()
    run("--params", "preset.yaml")
    assert (tmp_path / "metrics" / "time" / "prepare_data.json").read_text() == written


def test_a_gsm8k_split_that_would_be_empty_is_refused_before_the_download(tmp_path):
    """All of GSM8K's train split for training leaves no validation row: refused from GSM8K's sizes
    (offline, so a download attempt would fail with the hub's line instead)."""
    params = tmp_path / "params.yaml"
    params.write_text(f"data: {{source: gsm8k, train_size: 7473, test_size: 1319, out_dir: {tmp_path}/raw}}\n")
    env = {**__import__("os").environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    proc = subprocess.run([sys.executable, "-m", "tasks.prepare_data", "--params", str(params)],
                          capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith(
        "prepare_data: error: data.val_size: 200 validation rows asked, but there are none: GSM8K's train split")
    assert not (tmp_path / "raw").exists()


def test_a_jsonl_source_whose_file_is_missing_is_one_line_naming_it(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text(f"data: {{source: jsonl, path: {tmp_path}/gone.jsonl, out_dir: {tmp_path}/raw}}\n"
                      f"train: {{metrics_dir: {tmp_path}/metrics}}\n")
    proc = subprocess.run([sys.executable, "-m", "tasks.prepare_data", "--params", str(params)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"prepare_data: error: data.path: {tmp_path}/gone.jsonl: file not found"]
