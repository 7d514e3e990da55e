"""bench/equal_reward_share.py's decomposition on the tiny 4-bit + LoRA Llama: the gradients of the
equal-reward rows and of the others, each a batch of its own whole groups at the step's normaliser,
add up to the whole update's; the equal-reward rows carry a gradient only through archer's KL term."""

from __future__ import annotations

import importlib.util
from types import SimpleNamespace

import pytest
import torch

from grpo.algorithm.entropy import build_token_rule
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import Dist
from grpo.core.types import TrainBatch
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.training.passes import PolicyPasses
from grpo.training.trainer_builder import loss_of
from grpo.training.updater import AdamWUpdater

from .conftest import REPO
from .helpers import LORA, give_adapter_a_say

spec = importlib.util.spec_from_file_location("equal_reward_share", REPO / "bench" / "equal_reward_share.py")
bench = importlib.util.module_from_spec(spec)
spec.loader.exec_module(bench)


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32"), LoraConfig(**LORA))
    give_adapter_a_say(model, std=0.3)  # the policy is not the reference: the KL term has a gradient
    return model.train(), load_tokenizer(tiny_model_dir)


def two_groups(tok) -> TrainBatch:
    """Two groups of two completions of one prompt: the first of equal rewards (advantage 0), the
    second with signal (+1, -1). (4, C) rows."""
    prompt = tok(["<|im_start|>user\n3+4?<|im_end|>\n<|im_start|>assistant\n"], add_special_tokens=False)["input_ids"][0]
    good, bad = tok(["#### 7<|im_end|>", "it is 9<|im_end|>"], add_special_tokens=False)["input_ids"]
    width, pad = max(len(good), len(bad)), tok.pad_token_id
    rows = (good, bad, good, bad)
    targets = torch.tensor([c + [pad] * (width - len(c)) for c in rows])  # (4, C)
    mask = torch.tensor([[1] * len(c) + [0] * (width - len(c)) for c in rows])  # (4, C)
    ids = torch.cat([torch.tensor([prompt] * 4), targets], dim=1)  # (4, P + C)
    attn = torch.cat([torch.ones(4, len(prompt), dtype=torch.long), mask], dim=1)
    return TrainBatch(ids, attn, targets, mask, torch.tensor([0.0, 0.0, 1.0, -1.0]), len(prompt))


def measured(model, tok, kl_low: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The whole update's gradient and its two parts' through the bench's ``part_gradient``, under
    archer with ``kl_low`` and two micro-batches."""
    cfg = TrainConfig(rollouts={"group_size": 2}, passes={"micro_batches": 2, "logprob_chunk": 5},
                      loss={"entropy_rule": "archer", "entropy_rule_options": {"archer": {"kl_low": kl_low}}})
    params = [p for p in model.parameters() if p.requires_grad]
    passes = PolicyPasses(model, cfg, Dist(), AdamWUpdater(params, cfg, Dist()), build_token_rule(cfg.loss), loss_of(cfg))
    trainer = SimpleNamespace(passes=passes, params=params)  # what part_gradient reads of a trainer
    batch = passes.fixed_logprobs(two_groups(tok))
    normalizer = passes.step_normalizer(batch.mask)
    whole, _, _ = bench.part_gradient(trainer, batch, normalizer, None)
    eq, _, _ = bench.part_gradient(trainer, batch[torch.tensor([0, 1])], normalizer, None)
    signal, _, _ = bench.part_gradient(trainer, batch[torch.tensor([2, 3])], normalizer, None)
    return whole, eq, signal


def test_the_parts_add_up_to_the_whole_and_the_equal_reward_rows_carry_the_kl(policy):
    model, tok = policy
    whole, eq, signal = measured(model, tok, kl_low=0.5)
    torch.testing.assert_close(eq + signal, whole, rtol=0, atol=1e-6)
    assert eq.norm() > 1e-4 and signal.norm() > 1e-4
    got = bench.shares(whole, eq, signal)
    rest = bench.shares(whole, signal, eq)  # the other part's projection share: the two sum to 1
    assert got["projection_share"] + rest["projection_share"] == pytest.approx(1.0, abs=1e-5)
    assert got["residual"] < 1e-5 and 0 < got["norm_share"]
    assert all(p.grad is None for p in model.parameters() if p.requires_grad)  # left cleared


def test_without_a_kl_term_the_equal_reward_rows_carry_nothing(policy):
    model, tok = policy
    whole, eq, signal = measured(model, tok, kl_low=0.0)
    assert float(eq.abs().max()) == 0.0
    torch.testing.assert_close(signal, whole, rtol=0, atol=1e-6)
    assert bench.shares(whole, eq, signal)["projection_share"] == 0.0
