"""One GRPO training step on CUDA with the 4-bit NF4 base + LoRA (skipped without a CUDA device).

The tiny random Llama of ``conftest.py`` in bitsandbytes NF4 on the GPU, bf16 compute, LoRA on
q/k/v/o, gradient checkpointing, two micro-batches, KL against the adapter-disabled reference, and
the Triton entropy/log-prob kernel (``kernel: auto`` picks it on CUDA).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from grpo.base_model import load_tokenizer
from grpo.config import LoraConfig, ModelConfig, TrainConfig
from grpo.policy import load_policy
from grpo.rewards import REWARDS
from grpo.trainer import GRPOTrainer

pytestmark = [pytest.mark.cuda, pytest.mark.slow,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_one_4bit_lora_step_on_cuda(tiny_model_dir, tiny_problems, tmp_path, monkeypatch):
    import bitsandbytes as bnb

    # a reward that differs within every group, so the update is non-zero whatever the model samples
    monkeypatch.setitem(REWARDS, "chars", lambda completions, answers: [float(len(c)) for c in completions])
    kernels = importlib.import_module("grpo.kernels.entropy_logprob")
    triton_calls = []
    real_triton = kernels.entropy_logprob_triton
    monkeypatch.setattr(kernels, "entropy_logprob_triton",
                        lambda *a, **kw: triton_calls.append(a[0].shape) or real_triton(*a, **kw))

    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), gradient_checkpointing=True),
                        LoraConfig(rank=8, alpha=16), "cuda")
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit and all(m.weight.device.type == "cuda" and m.weight.quant_state.quant_type == "nf4"
                            for m in four_bit)
    assert four_bit[0].compute_dtype == torch.bfloat16  # model.dtype auto: bf16 on CUDA
    cfg = TrainConfig(output_dir=str(tmp_path), steps=1, prompts_per_step=2, group_size=4, max_new_tokens=8,
                      micro_batches=2, beta=0.04, checkpoint_every=0, rewards={"correctness": 1.0, "chars": 0.01})
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    (row,) = GRPOTrainer(model, tok, cfg, tiny_problems).train(progress=False)

    assert row["step"] == 1 and row["completion_len"] > 0
    assert row["peak_mem_mb"] > 0 and row["peak_reserved_mb"] >= row["peak_mem_mb"]
    assert triton_calls  # the fused kernel computed the entropies and log-probs
    assert 0 < row["kept_frac"] <= 0.35
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)
    assert all(p.device.type == "cuda" for p in model.parameters() if p.requires_grad)
