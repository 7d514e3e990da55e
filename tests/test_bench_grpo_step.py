"""The GRPO-step benchmark at toy size on the CPU: it runs a full step and reports what it measured."""

import json
import subprocess
import sys

import pytest

from grpo.sections.train import TrainConfig

from .conftest import REPO

BENCH = REPO / "bench" / "grpo_step.py"


def test_every_saving_switch_is_a_valid_train_config():
    sys.path.insert(0, str(BENCH.parent))
    try:
        from grpo_step import SAVINGS, train_fields
    finally:
        sys.path.remove(str(BENCH.parent))
    for name, overrides in SAVINGS.items():
        TrainConfig(**train_fields(overrides))  # a typo in a switch would fail here, not on the GPU
        assert overrides, name


@pytest.mark.slow
def test_grpo_step_bench_smoke_at_toy_size(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(BENCH), "--arch", "toy", "--rollout", "transformers", "--steps", "1", "--prompts", "1", "--group", "2",
           "--new-tokens", "4", "--prompt-tokens", "24", "--fixed-length", "--micro-batches", "2",
           "--generation-batch", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median step s" in proc.stdout
    (step,) = json.loads(out.read_text())["ours"]["steps"]
    assert step["completion_len"] == 4  # EOS suppressed: every completion is full length
    assert step["peak_rss_mb"] > 100 and step["step_s"] > 0
    assert step["step_s"] >= step["generate"] + step["fwd_bwd"] > 0
