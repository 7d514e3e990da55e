"""The GRPO-step benchmark at toy size on the CPU: it runs a full step and reports what it measured."""

import json
import subprocess
import sys

import pytest

from grpo.config.params import AllParams
from grpo.training.trainer_builder import depart

from .conftest import REPO

BENCH = REPO / "bench" / "grpo_step.py"


def _bench():
    sys.path.insert(0, str(BENCH.parent))
    try:
        import grpo_step
    finally:
        sys.path.remove(str(BENCH.parent))
    return grpo_step


def _args(**kw):
    import argparse

    base = dict(gradient_checkpointing=False, steps=1, prompts=4, group=8, new_tokens=64, quantile=0.2, beta=0.0,
                lr=5e-4, micro_batches=1, generation_batch=0, gpu_memory_utilization=0.3)
    return argparse.Namespace(**{**base, **kw})


def test_every_saving_switch_is_a_valid_departure(tmp_path):
    bench = _bench()
    for name, overrides in bench.SAVINGS.items():
        assert overrides, name  # a typo in a switch fails here (ParamsError), not on the GPU
        depart(AllParams(), bench.departures(_args(), overrides, tmp_path, "m", "transformers"))


def test_ours_runs_trls_rule_at_mu_1_and_the_default_rule_at_its_own_mu(tmp_path):
    """The like-for-like line: TRL's rule (top quantile, no KL) and TRL's one update per batch; the
    params' default rule beside it with the default's ``mu`` (issue 58: not at TRL's 1)."""
    bench = _bench()
    ours = depart(AllParams(), bench.departures(_args(), {}, tmp_path, "m", "transformers")).train
    assert (ours.loss.entropy_rule, ours.optimizer.mu, ours.loss.beta) == ("high", 1, 0.0)
    default = depart(AllParams(), bench.departures(_args(), bench.default_rule_overrides(0.2), tmp_path, "m", "vllm")).train
    want = AllParams().train
    assert (default.loss.entropy_rule, default.optimizer.mu, default.optimizer.equal_reward_groups) == \
        (want.loss.entropy_rule, want.optimizer.mu, want.optimizer.equal_reward_groups)
    assert default.loss.rule_options() == want.loss.rule_options()


@pytest.mark.slow
def test_grpo_step_bench_smoke_at_toy_size(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [sys.executable, str(BENCH), "--arch", "toy", "--rollout", "transformers", "--steps", "1", "--prompts", "1", "--group", "2",
           "--new-tokens", "4", "--prompt-tokens", "24", "--fixed-length", "--micro-batches", "2",
           "--generation-batch", "1", "--json", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "median step s" in proc.stdout and "ours: the default params but" in proc.stdout
    (step,) = json.loads(out.read_text())["ours"]["steps"]
    assert step["completion_len"] == 4  # EOS suppressed: every completion is full length
    assert step["peak_rss_mb"] > 100 and step["step_s"] > 0
    assert step["step_s"] >= step["generate"] + step["fwd_bwd"] > 0
