"""bench/device_train.py on the CPU: the train stage whole at toy sizes, two unbroken runs and one
killed with -9 after its first checkpoint and resumed, the pairs' adapters compared, the budget that
leaves parts out, and the params it runs with."""

from __future__ import annotations

import json
import subprocess
import sys
from argparse import Namespace

import pytest
import yaml

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import device_train  # noqa: E402
from report_schema import schema_errors  # noqa: E402


def test_the_stage_runs_seed_003s_shapes_with_a_checkpoint_every_step_and_the_decode_loop(tmp_path):
    """The params file: the preset over params.yaml, the base given, a checkpoint every step,
    validation at step N, the decode loop, and the added reward beside the preset's."""
    from grpo.algorithm.rewards import REWARDS
    from grpo.config.params import params_from_dict
    from grpo.tools.cli import resolve_params

    args = Namespace(params="presets/seed003.yaml", steps=2, eval_tokens=None, dry_run=False)
    path, train = device_train.stage_params(args, tmp_path, tmp_path / "base", "unbroken")
    seed003 = resolve_params(REPO / "presets" / "seed003.yaml").params.train
    with REWARDS.registered("text_length", device_train.text_length):
        written = params_from_dict(yaml.safe_load(path.read_text()))
    assert written.train.model_dump() == train and written.model.path == str(tmp_path / "base")
    r = train["rollouts"]
    assert (r["prompts_per_step"], r["group_size"], r["max_new_tokens"], train["passes"]["micro_batches"]) == (
        seed003.rollouts.prompts_per_step, seed003.rollouts.group_size, seed003.rollouts.max_new_tokens, seed003.passes.micro_batches)
    assert train["loss"]["entropy_rule"] == seed003.loss.entropy_rule and train["optimizer"]["mu"] == seed003.optimizer.mu
    assert (train["steps"], train["checkpoints"]["every"], train["checkpoints"]["eval_every"], r["backend"]) == (
        2, 1, 2, "transformers")
    assert train["checkpoints"]["eval_max_new_tokens"] == seed003.rollouts.max_new_tokens  # the rollouts' shape
    assert train["rewards"] == {**seed003.rewards, "text_length": 1.0} and "text_length" not in REWARDS
    assert train["output_dir"] == str(tmp_path / "unbroken" / "out")


def test_the_deterministic_runs_params_differ_in_the_switch_alone(tmp_path):
    args = Namespace(params="presets/seed003.yaml", steps=2, eval_tokens=64, dry_run=False)
    _, plain = device_train.stage_params(args, tmp_path, tmp_path / "base", "unbroken")
    _, det = device_train.stage_params(args, tmp_path, tmp_path / "base", "deterministic", deterministic=True)
    assert det.pop("deterministic") and not plain.pop("deterministic")
    assert {k: v for k, v in det.items() if "dir" not in k} == {k: v for k, v in plain.items() if "dir" not in k}


def test_a_pair_of_adapters_is_compared_by_bytes_then_by_their_largest_difference(tmp_path):
    import torch
    from safetensors.torch import save_file

    for name, value in (("a", 0.5), ("b", 0.5), ("c", 0.625)):
        (tmp_path / name / "adapter").mkdir(parents=True)
        save_file({"w": torch.full((2, 2), value)}, tmp_path / name / "adapter" / "adapter_model.safetensors")
    rec = {n: {"adapter_sha256": device_train.sha256(tmp_path / n / "adapter" / "adapter_model.safetensors")}
           for n in "abc"}
    assert device_train.pair(rec["a"], rec["b"], tmp_path / "a", tmp_path / "b") == {"same_bytes": True,
                                                                                     "max_abs_diff": 0.0}
    assert device_train.pair(rec["a"], rec["c"], tmp_path / "a", tmp_path / "c") == {"same_bytes": False,
                                                                                     "max_abs_diff": 0.125}
    assert device_train.pair(rec["a"], None, tmp_path / "a", tmp_path / "c") == {"same_bytes": None,
                                                                                 "max_abs_diff": None}


def test_a_part_starts_only_when_its_expected_time_fits_the_budget():
    clock, e, keep = device_train.Clock(100), device_train.EXPECTED, device_train.EXPORT_S
    unbroken = 0.99 * (100 - keep) / e["killed"]  # the killed run's expected time just fits
    assert clock.fits("killed", unbroken) and not clock.fits("unbroken_again", unbroken)
    assert not clock.fits("deterministic", 1.01 * (100 - keep) / e["deterministic"])
    assert device_train.Clock(None).fits("deterministic", 1e6)


def test_the_budget_counts_from_the_process_start_not_from_the_first_part():
    """The device check's phase limit starts when the script's process starts: the clock that
    ``main`` gives the parts starts at the module's import (``STARTED``), so the time spent on the
    imports and the base's build is spent from the budget."""
    import time

    spent = time.monotonic() - device_train.STARTED
    clock = device_train.Clock(100, start=device_train.STARTED)
    assert spent > 0 and clock.left() <= 100 - spent and clock.elapsed() >= spent


def test_validation_reuses_the_rollouts_compiled_shape_at_seed_003s_sizes(tmp_path):
    """At seed 003's 2 steps x 512 tokens the stage's decode step is compiled on CUDA (1024 token
    steps reach decode.compile_min_tokens); each call is padded to its compiled shape by the
    library's own ``bucketed_call``. Every step's call (two prompts of the data, 8 completions each)
    and the validation's (``val_rows`` problems, one completion each) come out at the same rows x
    positions, so a process compiles one shape, not two."""
    import torch

    from grpo.data.sources import build_prompt
    from grpo.rollout.sampling import Sampling, bucketed_call, plan_decode
    from grpo.tools.cli import resolve_params
    from grpo.tools.synthetic import architecture_config, char_tokenizer

    args = Namespace(params="presets/seed003.yaml", steps=2, eval_tokens=None, dry_run=False)
    _, train = device_train.stage_params(args, tmp_path, tmp_path / "base", "unbroken")
    decode = resolve_params(REPO / "presets" / "seed003.yaml").params.decode
    r, c = train["rollouts"], train["checkpoints"]
    assert plan_decode(decode, "cuda", train["steps"] * r["max_new_tokens"]).loop.compiled
    tok = char_tokenizer(architecture_config("qwen2-1.5b").vocab_size)
    tok.padding_side = "left"

    def shape(rows: list[dict], samples: int, new_tokens: int) -> tuple[int, int]:
        enc = tok([build_prompt(tok, row["question"], train["system_prompt"]) for row in rows], return_tensors="pt",
                  padding=True, add_special_tokens=False)
        s = Sampling(new_tokens, torch.tensor([0]), 0, 1.0, 1.0, 0, None)
        ids, _, _ = bucketed_call(enc["input_ids"], enc["attention_mask"], s, samples, decode.loop_options["static"].length_bucket)
        return ids.shape[0] * samples, ids.shape[1] + new_tokens

    data, n = device_train.arithmetic_rows(64), r["prompts_per_step"]
    steps = {shape(data[i:i + n], r["group_size"], r["max_new_tokens"]) for i in range(0, len(data), n)}
    val = shape(device_train.arithmetic_rows(device_train.val_rows(train), "v"), 1, c["eval_max_new_tokens"])
    assert steps == {val} and val[0] == r["prompts_per_step"] * r["group_size"]


def test_fewer_than_two_steps_is_a_usage_error():
    with pytest.raises(SystemExit) as err:
        device_train.parse_args(["--steps", "1"])
    assert err.value.code == 2


@pytest.mark.slow
def test_the_dry_run_kills_resumes_and_ships_the_unbroken_runs_adapter_bytes(tmp_path):
    """On the CPU two unbroken runs and the resumed run ship the same adapter bytes, so the
    deterministic runs are not needed (``--deterministic auto``); the two lanes ran side by side (a
    CPU always); each completed run validated at step 2 and wrote its adapter, the dense export
    exists; no CUDA figures; the setup before the first part was spent from the budget."""
    out = tmp_path / "train.json"
    done = subprocess.run([sys.executable, "bench/device_train.py", "--dry-run", "--budget-s", "580", "--json",
                           str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    report = json.loads(out.read_text())
    assert schema_errors(report, device_train.SCHEMA) == []
    assert report["ok"] and report["device"] == "cpu"
    assert [report[r]["steps"] for r in ("unbroken", "unbroken_again", "killed", "resumed")] == [[1, 2], [1, 2], [1], [2]]
    assert report["unbroken_pair"] == {"same_bytes": True, "max_abs_diff": 0.0} and report["skipped"] == []
    assert report["deterministic_why"] == "not needed: no pair's bytes differ" and report["deterministic"]["rc"] is None
    assert report["killed"]["rc"] == -9 and report["killed_after"] == ["step_000001"] and not report["killed"]["adapter"]
    assert report["resumed_from"] == 1 and report["steps_complete"]
    assert report["same_adapter_bytes"] and report["adapter_max_abs_diff"] == 0.0
    for run in ("unbroken", "unbroken_again", "resumed"):
        assert report[run]["rc"] == 0 and report[run]["adapter"] and report[run]["val_accuracy"] is not None
        assert report[run]["peak_allocated_gib"] is None  # a CUDA figure
    assert report["dense_export"]["files"] and report["dense_export"]["gib"] > 0
    assert report["lanes"] == 2 and report["val_rows"] == report["rows"] and report["estimate_gib"] > 0
    assert report["setup_s"] >= report["build_s"] > 0 and report["budget_s"] == 580
    assert all(report[r]["compiled"] == [] for r in ("unbroken", "unbroken_again", "resumed"))  # no compile off CUDA
