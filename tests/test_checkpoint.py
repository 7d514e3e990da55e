"""Checkpoints (``grpo.training.checkpoint``): manifest and checksums, fall-back past damaged checkpoints,
no code run by loading one, fingerprint reset; on the tiny random model."""

from __future__ import annotations

import json
import logging
import os
import pickle
import random
import shutil
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo.config.overlay import overlay_params
from grpo.config.params import params_from_dict
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.jsonio import write_jsonl
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.training import checkpoint
from grpo.training.trainer import GRPOTrainer

from .helpers import DETERMINISTIC, _steps, _train, _write_params, make_trainer

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
STEPS = 4  # in-process runs: a checkpoint after every step, "killed" after step 4 is logged


# ---------------------------------------------------------------------------- helpers
class _Killed(Exception):
    pass


class _Payload:
    """Unpickling this creates ``marker``: stands for any code a pickle can carry."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def _damage(file: Path, how: str) -> None:
    if how == "noise":  # 1 kB of random bytes instead of the file
        file.write_bytes(os.urandom(1024))
    elif how == "same_size_noise":  # only the checksum can tell
        file.write_bytes(os.urandom(file.stat().st_size))
    elif how == "truncate":
        file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])
    elif how == "delete":
        file.unlink()
    else:
        raise ValueError(how)


def _grpo_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING and r.name.startswith("grpo")]


def _rows(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    """One 4-bit + LoRA policy for the module, with its initial adapter (each trainer starts from it)."""
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    return model, load_tokenizer(tiny_model_dir), checkpoint.adapter_state(model)


def _trainer(policy, problems, out: Path, callbacks=None) -> GRPOTrainer:
    from peft import set_peft_model_state_dict

    model, tok, initial = policy
    set_peft_model_state_dict(model, initial)
    torch.manual_seed(0)
    cfg = TrainConfig(output_dir=str(out), steps=STEPS, rewards={"correctness": 1.0, "format_soft": 0.5}, rollouts={"prompts_per_step": 1, "group_size": 2, "max_new_tokens": 6}, checkpoints={"every": 1})
    return make_trainer(model, tok, cfg, problems, callbacks=callbacks)


@pytest.fixture(scope="module")
def crashed(policy, tiny_problems, tmp_path_factory) -> Path:
    """``output_dir`` of a run stopped after step 4 was logged, before its checkpoint: checkpoints
    ``step_000002`` and ``step_000003`` (the two newest), ``steps.jsonl`` with steps 1..4."""
    out = tmp_path_factory.mktemp("crashed") / "out"

    def kill_at_last_step(row: dict) -> None:
        if row["step"] == STEPS:
            raise _Killed

    with pytest.raises(_Killed):
        _trainer(policy, tiny_problems, out, [kill_at_last_step]).train(progress=False)
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_000002", "step_000003"]
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]
    return out


def _resume_copy(policy, problems, crashed: Path, tmp_path: Path, damage) -> tuple[Path, list[dict]]:
    """Copy the crashed run, damage it with ``damage(checkpoints_dir)``, train it to the end;
    return the output dir and the rows of the run."""
    out = tmp_path / "out"
    shutil.copytree(crashed, out)
    damage(out / "checkpoints")
    rows = _trainer(policy, problems, out).train(progress=False)
    return out, rows


def _assert_resumed_from_step_2(out: Path, rows: list[dict], crashed: Path, caplog) -> None:
    before = _rows(crashed)
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]  # each step once
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert _rows(out)[:2] == before[:2]  # kept from the log, not trained again
    for a, b in zip(before[2:], _rows(out)[2:]):  # steps 3 and 4 trained again from step 2's state
        assert {k: a[k] for k in DETERMINISTIC} == pytest.approx({k: b[k] for k in DETERMINISTIC}, rel=1e-5, abs=1e-6)
    assert any("resumed from" in r.getMessage() and "step_000002 (step 2)" in r.getMessage() for r in caplog.records)
    # the damaged step_000003 was moved aside and did not block saving step 3 again
    kept = checkpoint.list_checkpoints(out / "checkpoints")
    assert [p.name for p in kept] == ["step_000003", "step_000004"]
    for p in kept:
        checkpoint.verify(p)
    assert (out / "checkpoints" / "damaged" / "step_000003").is_dir()


# ---------------------------------------------------------------------------- cheap unit checks
def test_rng_states_round_trip_through_the_weights_only_loader(tmp_path):
    torch.manual_seed(1)
    np.random.seed(1)
    random.seed(1)
    np.random.standard_normal()  # a cached gaussian in numpy's state
    torch.save(checkpoint.rng_state(), tmp_path / "rng.pt")
    expected = (torch.rand(3), np.random.rand(3), np.random.standard_normal(), [random.random() for _ in range(3)])
    checkpoint.set_rng_state(torch.load(tmp_path / "rng.pt", weights_only=True))
    got = (torch.rand(3), np.random.rand(3), np.random.standard_normal(), [random.random() for _ in range(3)])
    assert torch.equal(got[0], expected[0]) and np.array_equal(got[1], expected[1])
    assert got[2] == expected[2] and got[3] == expected[3]


def test_fingerprint_resets_output_dir_when_params_or_data_change(tiny_model_dir, tiny_problems, tmp_path):
    import yaml

    raw = yaml.safe_load(_write_params(tmp_path, tiny_model_dir, tiny_problems).read_text())
    out = Path(raw["train"]["output_dir"])

    def run(**train) -> bool:
        """reset_if_changed with these train params; True if the previous output survived."""
        params = params_from_dict(overlay_params(raw, {"train": train}))  # a part named merged key by key
        checkpoint.reset_if_changed(params)
        survived = (out / "kept").exists()
        (out / "kept").touch()
        assert (out / "fingerprint").read_text().strip() == checkpoint.fingerprint(params)
        return survived

    assert not run()  # first run: nothing to keep
    assert run()  # same params and data
    assert run(checkpoints={"every": 5}, metrics_dir=str(tmp_path / "elsewhere"))  # placement and logging only
    assert not run(optimizer={"lr": 1e-3})  # another run
    assert not run()  # and back
    before = checkpoint.fingerprint(params_from_dict(raw))
    write_jsonl(tmp_path / "train.jsonl", tiny_problems[:-1])
    assert not run()  # other data
    moved = sorted((tmp_path / "out.previous").iterdir())  # three runs moved aside (none deleted), the newest kept
    assert len(moved) == checkpoint.PREVIOUS_RUNS_KEPT and all((p / "kept").exists() for p in moved)
    assert moved[-1].name.endswith("_" + before)
    assert run(optimizer={"lr": 2e-3}) is False and sorted((tmp_path / "out.previous").iterdir())[:-1] == moved[1:]  # the oldest went


# ---------------------------------------------------------------------------- save / read
@pytest.mark.slow
def test_save_replaces_a_same_step_directory_keeps_two_and_reads_back(policy, tmp_path):
    from peft import get_peft_model_state_dict

    model = policy[0]
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    ckpts = tmp_path / "checkpoints"
    (ckpts / "step_000003").mkdir(parents=True)
    (ckpts / "step_000003" / "adapter.safetensors").write_bytes(b"junk")  # a damaged one left in place
    (ckpts / ".tmp_step_000001").mkdir()  # a temporary left by a killed run
    for step in (3, 4, 5):
        checkpoint.save(ckpts, step, model, optimizer, scheduler, data_position=step)
    assert sorted(p.name for p in ckpts.iterdir()) == ["step_000004", "step_000005"]
    manifest = checkpoint.verify(ckpts / "step_000005")
    assert manifest["step"] == 5 and set(manifest["files"]) == {"adapter.safetensors", "state.pt"}
    ckpt = checkpoint.read(ckpts / "step_000005")
    assert ckpt.step == 5 and ckpt.data_position == 5
    expected = get_peft_model_state_dict(model)
    assert ckpt.adapter.keys() == expected.keys()
    for k, v in ckpt.adapter.items():
        assert torch.equal(v, expected[k])
    assert checkpoint.latest(ckpts) == ckpts / "step_000005"


# ---------------------------------------------------------------------------- damaged checkpoints
REASONS = {"noise": "bytes, the manifest says", "same_size_noise": "sha256", "truncate": "bytes, the manifest says",
           "delete": "is missing"}


@pytest.mark.slow
@pytest.mark.parametrize("how", ["noise", "same_size_noise", "truncate", "delete"])
@pytest.mark.parametrize("name", ["adapter.safetensors", "state.pt", "manifest.json"])
def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(policy, tiny_problems, crashed, tmp_path, caplog,
                                                                   name, how):
    """Each file of the newest checkpoint damaged in turn: one warning naming it and the reason,
    resume from the previous checkpoint, every step logged once, the run ends at its step count."""
    caplog.set_level(logging.INFO)
    out, rows = _resume_copy(policy, tiny_problems, crashed, tmp_path,
                             lambda ckpts: _damage(ckpts / "step_000003" / name, how))
    warnings = _grpo_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(out / "checkpoints" / "step_000003") in warnings[0] and name in warnings[0]
    reason = "is missing" if how == "delete" else "is unreadable" if name == "manifest.json" else REASONS[how]
    assert reason in warnings[0]
    _assert_resumed_from_step_2(out, rows, crashed, caplog)


@pytest.mark.slow
def test_all_checkpoints_damaged_starts_afresh_from_step_0(policy, tiny_problems, crashed, tmp_path, caplog):
    caplog.set_level(logging.INFO)

    def damage(ckpts: Path) -> None:
        _damage(ckpts / "step_000003" / "adapter.safetensors", "noise")
        _damage(ckpts / "step_000002" / "state.pt", "truncate")

    out, rows = _resume_copy(policy, tiny_problems, crashed, tmp_path, damage)
    warnings = _grpo_warnings(caplog)
    assert len(warnings) == 3, warnings  # one per damaged checkpoint, one for the fresh start
    assert str(out / "checkpoints" / "step_000003") in warnings[0]
    assert str(out / "checkpoints" / "step_000002") in warnings[1]
    assert "starting afresh from step 0" in warnings[2]
    assert not any("resumed from" in r.getMessage() for r in caplog.records)
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4] and [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(a["step_time_s"] != b["step_time_s"] for a, b in zip(_rows(crashed), _rows(out)))  # all trained anew
    assert [p.name for p in checkpoint.list_checkpoints(out / "checkpoints")] == ["step_000003", "step_000004"]


@pytest.mark.slow
def test_pickled_object_in_the_state_is_refused_without_running_it(policy, tiny_problems, crashed, tmp_path, caplog):
    """A state.pt carrying an object whose unpickling would run code, with a manifest that matches
    it: the loader refuses it (one warning, fall back), and the code never runs."""
    caplog.set_level(logging.INFO)
    marker = tmp_path / "pwned"
    probe = tmp_path / "probe"
    pickle.loads(pickle.dumps(_Payload(probe)))  # the payload does run code when unpickled
    assert probe.exists()

    def plant(ckpts: Path) -> None:
        path = ckpts / "step_000003"
        torch.save({"step": 3, "data_position": 3, "payload": _Payload(marker)}, path / "state.pt")
        checkpoint.write_manifest(path, 3)
        checkpoint.verify(path)  # the checksums match: only the loader can refuse it

    try:
        out, rows = _resume_copy(policy, tiny_problems, crashed, tmp_path, plant)
    finally:
        assert not marker.exists(), "loading the checkpoint ran the pickled code"
    warnings = _grpo_warnings(caplog)
    assert len(warnings) == 1, warnings
    assert str(out / "checkpoints" / "step_000003") in warnings[0] and "weights-only" in warnings[0]
    _assert_resumed_from_step_2(out, rows, crashed, caplog)


@pytest.mark.slow
def test_stage_killed_then_newest_adapter_damaged_resumes_from_the_previous_checkpoint(
    tiny_model_dir, tiny_problems, tmp_path
):
    """The real stage: ``kill -9`` once step 6's checkpoint exists (every 2 steps), its adapter
    overwritten with 1 kB of noise; the restart warns once, resumes from step 4 and exits 0."""
    params = _write_params(tmp_path, tiny_model_dir, tiny_problems, steps=8, checkpoints={"every": 2})
    ckpts = tmp_path / "out" / "checkpoints"
    proc = _train(params)
    deadline = time.time() + 300
    while not (ckpts / "step_000006").exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert (ckpts / "step_000006").exists(), proc.communicate()[0]
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate()
    killed_rows = {r["step"]: r for r in _steps(tmp_path)}
    _damage(ckpts / "step_000006" / "adapter.safetensors", "noise")

    proc = _train(params)
    out, _ = proc.communicate(timeout=600)
    assert proc.returncode == 0, out
    assert "Traceback" not in out
    # bitsandbytes warns once on CPUs with AVX512-BF16 that its optional `kernels` package is missing
    warnings = [line for line in out.splitlines() if "WARNING" in line and "kernels-community" not in line]
    assert len(warnings) == 1 and str(ckpts / "step_000006") in warnings[0], warnings
    assert "adapter.safetensors" in warnings[0]
    assert "step_000004 (step 4)" in out
    rows = _steps(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 9))
    for r in rows[4:6]:  # steps 5 and 6 again from step 4's state: as before the kill
        a = killed_rows[r["step"]]
        assert {k: a[k] for k in DETERMINISTIC} == pytest.approx({k: r[k] for k in DETERMINISTIC}, rel=1e-5, abs=1e-6)
    assert (tmp_path / "adapter" / "adapter_model.safetensors").exists()
