"""DeepSpeed ZeRO-2 with the optimizer offloaded to CPU (``train.distribution.deepspeed_config``, ``grpo.training.zero``) on
the tiny model: the shipped configs parse and accelerate's plugin takes the JSON; 1 and 2 gloo
processes under ZeRO-2 + DeepSpeedCPUAdam make the plain path's steps; resume restarts the moments
from the checkpoint's weights.

Skipped where deepspeed is not installed (``pip install -e .[deepspeed]``). The first run JIT-builds
DeepSpeed's ``cpu_adam`` and ``deepspeed_shm_comm`` ops (minutes; cached in ~/.cache/torch_extensions).
"""

from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist, init_from_env, shutdown
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.training import checkpoint

from .conftest import REPO
from .helpers import make_trainer

pytest.importorskip("deepspeed", reason="deepspeed is not installed (optional: pip install -e .[deepspeed])")

pytestmark = pytest.mark.slow

LORA = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
ZERO2_OFFLOAD = {"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}  # fp32: exact comparisons
PROBLEMS = [{"id": f"p{i}", "question": f"What is {a} + {b}?", "answer": str(a + b)}
            for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2), (5, 1)])]


def _length_rewards(completions: list[str], answers: list[str], weights: dict) -> tuple[list[float], dict]:
    """Rewards that differ within groups on a random model (correctness is 0 everywhere there)."""
    values = [len(c) % 5 / 4 for c in completions]
    return values, {"length": values}


def _trainer(model_dir: str, out: Path, dist: Dist, monkeypatch=None, **train):
    """A trainer on the tiny 4-bit model with a seeded non-zero adapter, 4 prompts x G = 2 a step."""
    import grpo.training.rollout_phase

    if monkeypatch is not None:
        monkeypatch.setattr(grpo.training.rollout_phase, "combined_rewards", _length_rewards)
    else:  # a spawned worker
        grpo.training.rollout_phase.combined_rewards = _length_rewards
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=model_dir, dtype="float32"), LoraConfig(**LORA))  # fp32 on every CPU
    gen = torch.Generator().manual_seed(1)
    for n, p in sorted(model.named_parameters()):
        if "lora_B" in n:
            p.data = torch.randn(p.shape, generator=gen) * 0.3  # non-zero adapter: gradients reach A and B
    cfg = TrainConfig(output_dir=str(out), steps=4, truncated="score", **train, rollouts={"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 8}, checkpoints={"every": 0, "eval_every": 0}, optimizer={"warmup_steps": 0, "lr": 1e-2, "weight_decay": 0.1}, loss={"entropy_rule_options": {"high": {"top_quantile": 0.5}}, "entropy_rule": "high"})  # a random model's completions all hit max_new_tokens: score them
    return make_trainer(model, load_tokenizer(model_dir), cfg, PROBLEMS, dist=dist)


def _lora(trainer) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}


def _assert_same_steps(rows, ref_rows, weights, ref_weights):
    for row, ref in zip(rows, ref_rows, strict=True):
        for key in ("loss", "grad_norm", "lr", "reward_mean", "kept_frac", "entropy_mean"):
            assert row[key] == pytest.approx(ref[key], rel=1e-4, abs=1e-6), (row["step"], key)
    for name, ref in ref_weights.items():
        torch.testing.assert_close(weights[name], ref, rtol=0, atol=1e-5, msg=lambda m, n=name: f"{n}: {m}")


@pytest.fixture(scope="module")
def plain_steps(tiny_model_dir, tmp_path_factory):
    """Two steps of the plain path (our AdamW, clip_grad_norm_) in one process: the reference."""
    with pytest.MonkeyPatch.context() as mp:
        trainer = _trainer(str(tiny_model_dir), tmp_path_factory.mktemp("plain"), Dist(), mp)
        rows = [trainer.train_step() for _ in range(2)]
    assert rows[0]["grad_norm"] > 1e-3 and rows[0]["kept_frac"] < 1
    return rows, _lora(trainer)


# ---------------------------------------------------------------------------- configs
def test_shipped_configs_parse_and_the_trainer_sets_the_update_fields(tmp_path):
    """The accelerate YAML names the JSON; accelerate's DeepSpeedPlugin takes it; ``engine_config``
    keeps ZeRO-2 + offload + bf16 and puts the trainer's optimizer, clipping and accumulation over
    seed 000's 8 accumulation steps; stage 3 and a JSON scheduler are refused, naming the param."""
    from accelerate.commands.config.config_args import load_config_from_file
    from accelerate.utils import DeepSpeedPlugin

    from grpo.training.zero import engine_config

    launch = load_config_from_file(str(REPO / "configs" / "accelerate" / "zero2_offload.yaml"))
    path = REPO / launch.deepspeed_config["deepspeed_config_file"]
    assert DeepSpeedPlugin(hf_ds_config=str(path)).zero_stage == 2
    cfg = TrainConfig(distribution={"deepspeed_config": str(path)}, passes={"micro_batches": 2}, rollouts={"prompts_per_step": 8, "group_size": 4}, optimizer={"lr": 3e-4, "max_grad_norm": 0.5})
    ds = engine_config(cfg, world_size=2)
    assert ds["zero_optimization"] == {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}}
    assert ds["bf16"] == {"enabled": True}
    assert ds["optimizer"]["type"] == "AdamW" and ds["optimizer"]["params"]["lr"] == 3e-4
    assert (ds["gradient_clipping"], ds["gradient_accumulation_steps"], ds["train_micro_batch_size_per_gpu"]) == (0.5, 2, 8)
    assert ds["managed_gradient_accumulation"] is False and "train_batch_size" not in ds
    for bad, needle in (({"zero_optimization": {"stage": 3}}, "stage 3"), ({**ZERO2_OFFLOAD, "scheduler": {}}, "scheduler"),
                        (None, "cannot read")):
        bad_path = tmp_path / "bad.json"
        bad_path.write_text(json.dumps(bad) if bad else "{not json")
        with pytest.raises(ValueError, match=f"train.distribution.deepspeed_config.*{needle}"):
            engine_config(TrainConfig(distribution={"deepspeed_config": str(bad_path)}), world_size=1)


# ---------------------------------------------------------------------------- the update
def test_one_process_zero2_offload_makes_the_plain_steps_and_resumes(tiny_model_dir, tmp_path, plain_steps,
                                                                     monkeypatch):
    """ZeRO-2 + DeepSpeedCPUAdam in one process, 2 micro-batches: the plain path's two steps (loss,
    grad norm before clipping, lr; LoRA weights to 1e-5). Then resume from its step-1 checkpoint in
    a fresh trainer: the loaded weights are the ones ZeRO steps from (its fp32 master copy takes
    them) and step 2 equals the plain path's step 2 with fresh AdamW moments."""
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(ZERO2_OFFLOAD))
    trainer = _trainer(str(tiny_model_dir), tmp_path / "zero", Dist(), monkeypatch, distribution={"deepspeed_config": str(ds)},
                       passes={"micro_batches": 2})
    assert type(trainer.updater.optimizer).__name__ == "DeepSpeedCPUAdam"
    first = trainer.train_step()
    path = trainer.save_checkpoint()
    second = trainer.train_step()
    _assert_same_steps([first, second], plain_steps[0], _lora(trainer), plain_steps[1])

    resumed = _trainer(str(tiny_model_dir), tmp_path / "zero", Dist(), monkeypatch, distribution={"deepspeed_config": str(ds)})
    resumed.resume()  # from the newest checkpoint of its run directory: the step-1 one
    assert resumed.step == 1
    plain = _trainer(str(tiny_model_dir), tmp_path / "plain", Dist(), monkeypatch)  # fresh AdamW moments
    ckpt = checkpoint.read(path)
    checkpoint.restore(ckpt, plain.model, SimpleNamespace(load_state_dict=lambda state: None), plain.scheduler)
    plain.step = ckpt.step
    for group in plain.updater.optimizer.param_groups:
        group["lr"] = plain.scheduler.get_last_lr()[0]  # what the checkpoint's optimizer state would set
    _assert_same_steps([resumed.train_step()], [plain.train_step()], _lora(resumed), _lora(plain))


def _zero_worker(rank: int, model_dir: str, port: int, out: str, ds: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2",
                      LOCAL_RANK=str(rank))
    torch.set_num_threads(1)
    dist = init_from_env("cpu", timeout_s=120)
    try:
        trainer = _trainer(model_dir, Path(out) / f"rank{rank}", dist, distribution={"deepspeed_config": ds})
        rows = [trainer.train_step() for _ in range(2)]
        torch.save({"rows": rows, "lora": _lora(trainer)}, Path(out) / f"rank{rank}.pt")
    finally:
        shutdown(dist)


def test_two_gloo_processes_under_zero2_offload_make_the_one_process_steps(tiny_model_dir, tmp_path, plain_steps):
    """2 processes (gloo), 2 prompts each, ZeRO-2 partitions the LoRA gradients and the CPU-offloaded
    AdamW state over them: both ranks log the plain single-process steps (the gradient norm before
    clipping catches a gradient averaged instead of summed) and hold its LoRA weights."""
    import torch.multiprocessing as mp

    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps(ZERO2_OFFLOAD))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_zero_worker, args=(str(tiny_model_dir), port, str(tmp_path), str(ds)), nprocs=2, join=True)
    for rank in range(2):
        got = torch.load(tmp_path / f"rank{rank}.pt", weights_only=False)
        _assert_same_steps(got["rows"], plain_steps[0], got["lora"], plain_steps[1])


def test_bf16_json_on_a_float32_policy_is_refused_naming_model_dtype(tiny_model_dir, tmp_path, monkeypatch):
    """Seed 000's JSON (bf16) would cast the whole float32 CPU policy to bfloat16 under the sampler's
    feet (measured: 'expected m1 and m2 to have the same dtype' in the first rollout)."""
    from grpo.config.reading import ParamsError

    with pytest.raises(ParamsError, match=r"bf16.enabled .* float32; set model.dtype: bfloat16"):
        _trainer(str(tiny_model_dir), tmp_path, Dist(), monkeypatch,
                 distribution={"deepspeed_config": str(REPO / "configs" / "accelerate" / "ds_zero2_offload.json")})
