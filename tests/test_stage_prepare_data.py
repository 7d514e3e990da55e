"""The prepare_data stage (``python -m tasks.prepare_data``): byte-identical outputs across runs, and an
offline gsm8k source reported in one line."""

import json
import subprocess
import sys


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
