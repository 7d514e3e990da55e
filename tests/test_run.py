"""``grpo.training.run``: a run from Python (``run(params)``, as the train stage calls it) ships the
adapter and the summary; the summary's fields; the line an interrupted run leaves; a multi-process
run needs the command of its workers. The stage end to end (resume after kill -9, Ctrl-C, wandb):
tests/test_stage_train.py; several processes: tests/test_distributed.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from grpo.config.params import load_params
from grpo.core.device import SDPA_FUSED, make_deterministic
from grpo.training.run import interrupted_line, run, train_summary

from .helpers import _write_params


@pytest.mark.slow
def test_a_run_from_python_ships_the_adapter_and_the_summary(tiny_model_dir, tiny_problems, tmp_path):
    params = load_params(_write_params(tmp_path, tiny_model_dir, tiny_problems, steps=2, checkpoints={"every": 0}))
    run(params)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
    summary = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert (summary["steps"], summary["num_processes"], summary["rollout_backend"]) == (2, 1, "transformers")
    assert (tmp_path / "metrics" / "train" / "metrics.json").exists()  # dvclive


def test_the_summary_leaves_out_the_gap_of_steps_not_applied():
    """A step whose update was not applied (a non-finite value) logs no gap (None): the summary's
    mean and largest gap come from the other steps, and the run does not fail at its end."""
    row = dict(rollout_accuracy=0.5, step_time_s=1.0, loss=0.1, reward_mean=0.5, kl=0.0, entropy_mean=1.0, kept_frac=0.2,
               peak_mem_mb=100.0)
    history = [{**row, "step": 1, "logp_mismatch_mean": 0.02, "logp_mismatch_max": 0.3},
               {**row, "step": 2, "logp_mismatch_mean": None, "logp_mismatch_max": None, "update_skipped": True},
               {**row, "step": 3, "logp_mismatch_mean": 0.04, "logp_mismatch_max": 0.5}]
    summary = train_summary(history, "vllm", 1, {"step": 3})
    assert summary["logp_mismatch_mean"] == pytest.approx(0.03) and summary["logp_mismatch_max"] == 0.5


def test_an_interrupted_run_before_its_first_checkpoint_says_a_rerun_starts_at_step_0(tiny_model_dir, tiny_problems,
                                                                                      tmp_path):
    params = load_params(_write_params(tmp_path, tiny_model_dir, tiny_problems))
    assert interrupted_line(params) == (
        f"interrupted; {tmp_path / 'adapter'} and {tmp_path / 'metrics' / 'train.json'} are unchanged (the last "
        f"completed run's, if any); no checkpoint yet in {tmp_path / 'out'}: a rerun starts at step 0")


def test_several_processes_need_the_command_of_a_worker(tiny_model_dir, tiny_problems, tmp_path, monkeypatch):
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    params = load_params(_write_params(tmp_path, tiny_model_dir, tiny_problems, distribution={"num_processes": 2}))
    with pytest.raises(ValueError, match="train.distribution.num_processes is 2: run.. needs `worker`"):
        run(params)
    assert not (tmp_path / "out").exists()


DETERMINISTIC_FLAGS = """
import os, sys, torch
from grpo.core.jsonio import DataError
from grpo.config.params import load_params
from grpo.training.run import run
for path in sys.argv[1:]:
    try:
        run(load_params(path))
    except DataError:  # no data: the run stops after the switch, before any model is built
        pass
    print(torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
          os.environ.get("CUBLAS_WORKSPACE_CONFIG"), torch.backends.cuda.cudnn_sdp_enabled())
"""


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_train_deterministic_turns_on_torchs_flag_and_the_cublas_workspace(tiny_model_dir, tiny_problems, tmp_path):
    """A real run in a fresh process (the flag is process-wide): off leaves torch as it is; on turns
    deterministic algorithms on (warn only) and sets the workspace before the model is built."""
    paths = []
    for on in (False, True):
        (tmp_path / str(on)).mkdir()
        path = _write_params(tmp_path / str(on), tiny_model_dir, tiny_problems, deterministic=on,
                             data_path=str(tmp_path / "missing.jsonl"))
        paths.append(str(path))
    env = {k: v for k, v in os.environ.items() if k != "CUBLAS_WORKSPACE_CONFIG"}
    out = subprocess.run([sys.executable, "-c", DETERMINISTIC_FLAGS, *paths], env=env, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["False False None True", "True True :4096:8 False"]


def test_make_deterministic_keeps_a_workspace_setting_already_made_and_leaves_sdpa_its_math(monkeypatch):
    """Under warn_only torch keeps the fused attention kernels (their backward only warns), so the
    switch turns them off itself: SDPA's math backend alone is left."""
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    kinds = (*SDPA_FUSED, "math")
    before = {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")() for k in kinds}
    try:
        assert make_deterministic() == ":16:8" and torch.are_deterministic_algorithms_enabled()
        assert {k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")() for k in kinds} == {
            **dict.fromkeys(SDPA_FUSED, False), "math": True}
    finally:
        torch.use_deterministic_algorithms(False)
        for kind, on in before.items():
            getattr(torch.backends.cuda, f"enable_{kind}_sdp")(on)


def test_acting_averages_where_the_rule_acted_over_the_steps_that_logged_it():
    """``metrics/train.json``'s means of the per-step shares (``grpo.training.metrics.rule_action_row``): a
    step without a share (no gradient, or no wider-clip token) is left out of its mean."""
    from grpo.training.run import acting

    history = [{"wide_band_frac": 0.0, "wide_band_grad_share": 0.0}, {"wide_band_frac": 0.1},
               {"wide_band_frac": 0.2, "wide_band_grad_share": 0.3, "kept_grad_share": 0.6}]
    out = acting(history)
    assert out["mean_wide_band_frac"] == pytest.approx((0.0 + 0.1 + 0.2) / 3)
    assert out["mean_wide_band_grad_share"] == pytest.approx((0.0 + 0.3) / 2)
    assert out["mean_kept_grad_share"] == pytest.approx(0.6)
    assert acting([{"step": 1}]) == {}


def test_the_stage_ends_on_one_short_line_of_the_figures_a_user_wants():
    from grpo.training.run import summary_line

    summary = {"steps": 40, "total_time_s": 301.4, "rollout_accuracy_first10": 0.1, "rollout_accuracy_last10": 0.6,
               "final_val_accuracy": 0.56, "final_val_ci_low": 0.5, "final_val_ci_high": 0.61, "adapter": {"x": 1} }
    line = summary_line(summary, "models/adapter", "metrics/train.json")
    assert line.startswith("done: 40 steps in 301 s") and "0.100 -> 0.600" in line and "validation 0.560 [0.500, 0.610]" in line
    assert "metrics/train.json" in line and len(line) < 200
    assert "validation" not in summary_line({k: v for k, v in summary.items() if "val" not in k}, "a", "b")
