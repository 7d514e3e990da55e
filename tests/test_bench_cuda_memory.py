"""The update traced on fake CUDA tensors (bench/cuda_memory.py) at tiny shapes agrees with
``grpo.tools.memory.estimate`` within 10% in every phase that the estimate has a figure for, so that the
estimate cannot drift from the code it describes.

The bench runs in a child process: its C++ shim (bench/fake_cuda) must be loaded before torch.
"""

import json
import subprocess
import sys

import pytest
import yaml

from .conftest import REPO

BENCH = REPO / "bench" / "cuda_memory.py"
TOLERANCE = 0.10
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=1024)
ARCHER = {"entropy_rule": "archer", "entropy_rule_options": {"archer": {"top_quantile": 0.2}}}
"""A rule with a reference pass (its KL) and a per-response threshold: the update's no-grad passes."""
SETUPS = {
    # seed 003's switches: NF4, gradient checkpointing, several micro-batches (the step-wide entropy pass)
    "checkpointed": {"model": {"quantization": "nf4", "gradient_checkpointing": True},
                     "train": {"passes": {"micro_batches": 2}, "loss": ARCHER}, "no_grad_pass": True},
    # no checkpointing, shared prompts, one micro-batch; with KL and mu 2: the reference pass
    "shared prompts, beta, mu 2": {"model": {"quantization": "nf4", "gradient_checkpointing": False},
                                   "train": {"passes": {"micro_batches": 1}, "loss": {**ARCHER, "beta": 0.04},
                                             "optimizer": {"mu": 2}}, "no_grad_pass": True},
    # a small vocabulary and a wide MLP: the body's backward, not the LM head, is the largest working set
    "body backward largest": {"model": {"quantization": "nf4", "gradient_checkpointing": True},
                              "train": {"passes": {"micro_batches": 2}, "loss": ARCHER},
                              "config": {"vocab_size": 512, "intermediate_size": 2048}, "no_grad_pass": True},
    # the default's rule (every token, mu 1, no KL): no no-grad pass at all
    "the default's rule": {"model": {"quantization": "nf4", "gradient_checkpointing": False},
                           "train": {"passes": {"micro_batches": 1}}, "no_grad_pass": False},
}


def tiny_workspace(path, overrides: dict):
    """A workspace (dvc.yaml, params.yaml) whose model is a tiny Qwen2 config.json (no weights;
    ``overrides["config"]`` changes its fields)."""
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", **{**TINY, **overrides.get("config", {})}).save_pretrained(path / "models" / "tiny")
    (path / "dvc.yaml").write_text("stages: {}\n")
    params = {"model": {"path": "models/tiny", **overrides["model"]},
              "lora": {"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
              "train": {**overrides["train"], "rollouts": {"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 64}}}
    (path / "params.yaml").write_text(yaml.safe_dump(params))
    return path / "params.yaml"


def disagreements(figures: dict) -> list[str]:
    """The phases whose traced figure is more than ``TOLERANCE`` away from the estimate's."""
    rows = {**figures["phases"], "peak": figures["peak"]}
    out = []
    for name, row in rows.items():
        if row["estimate_bytes"] and abs(row["ratio"] - 1) > TOLERANCE:
            out.append(f"{name}: traced {row['traced_bytes']:,} B, estimate {row['estimate_bytes']:,} B "
                       f"(ratio {row['ratio']})")
    return out


@pytest.mark.slow
@pytest.mark.parametrize("setup", SETUPS)
def test_traced_update_agrees_with_the_estimate(tmp_path, setup):
    params = tiny_workspace(tmp_path, SETUPS[setup])
    out = tmp_path / "figures.json"
    run = subprocess.run([sys.executable, str(BENCH), "--params", str(params), "--prompt-tokens", "32",
                          "--json", str(out)], capture_output=True, text=True, cwd=REPO, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    figures = json.loads(out.read_text())
    phases = figures["phases"]
    micro = [name for name in phases if name.startswith("micro-batch")]
    assert micro and "optimizer step" in phases, list(phases)
    assert ("no-grad pass" in phases) == SETUPS[setup]["no_grad_pass"], list(phases)
    assert not disagreements(figures), "the trace and grpo.tools.memory.estimate disagree:\n" + "\n".join(
        disagreements(figures))
    if SETUPS[setup]["no_grad_pass"]:  # the estimate counts the no-grad passes as smaller than the training pass
        assert phases["no-grad pass"]["traced_bytes"] < figures["peak"]["traced_bytes"]
    assert figures["replaced"] and "CUDA context" in figures["not_counted"]


@pytest.fixture(scope="module")
def every_call(tmp_path_factory):
    """``bench/cuda_memory.py --all`` at seed 003's preset shapes (minutes: the 1.5B on fake tensors)."""
    out = tmp_path_factory.mktemp("calls") / "calls.json"
    run = subprocess.run([sys.executable, str(BENCH), "--all", "--params", str(REPO / "presets" / "seed003.yaml"),
                          "--json", str(out)], capture_output=True, text=True, cwd=REPO, timeout=1800)
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(out.read_text()), run.stdout


@pytest.mark.slow
def test_every_cuda_call_of_seed003_fits_under_its_prediction_and_the_card(every_call):
    """SENT's call, the evaluation's and the train step whole, traced through the stages' code at
    seed 003's shapes on the decode loop with its compiled step: each traced peak <= ``grpo
    check``'s prediction <= the 7.6 GiB card less the measured CUDA context; printed as written."""
    figures, stdout = every_call
    calls = figures["calls"]
    assert sorted(calls) == ["evaluation", "sent", "train_step"]
    for name, row in calls.items():
        assert row["traced_bytes"] <= row["predicted_bytes"], name
        assert row["predicted_gib"] <= row["cap_gib"] - row["context_gib"], name
        assert row["cap_gib"] == 7.6 and f"  {name:<11} traced {row['traced_gib']:.3f} GiB" in stdout
    assert calls["sent"]["per_call"] == calls["sent"]["predicted_per_call"]  # the split grpo check predicts


@pytest.mark.slow
def test_compiled_steps_are_held_once_and_released_with_their_sampler(every_call):
    """The samplers' compiled steps (and their caches) are gone once the sampler closes; the train
    step holds one step through its update, and validation's calls ran on it (no new shape)."""
    calls = every_call[0]["calls"]
    for name in ("sent", "evaluation"):
        assert calls[name]["held_steps"] and calls[name]["released"], name
        assert calls[name]["after_close"] < calls[name]["kept_after_call"], name
    train = calls["train_step"]
    assert len(train["held_steps"]) == 1 and train["held_steps"] == train["held_after_step_1"]
    assert train["released"]
