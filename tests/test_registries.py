"""Each registry of ``grpo.choices``: a toy entry, defined here and registered for the test alone,
is chosen through the params and used by a real training step on the tiny model.

The loss (``grpo.loss.POLICY_LOSSES``, ``grpo.loss.AGGREGATIONS``) and the token-entropy rules
(``grpo.entropy.TOKEN_RULES``) so far. That every registered name validates and resolves:
tests/test_choices.py.
"""

from __future__ import annotations

import pytest
import torch

from grpo.base_model import load_tokenizer
from grpo.config import LoraConfig, ModelConfig, params_from_dict
from grpo.entropy import TOKEN_RULES, TokenRule
from grpo.lora_policy import load_policy
from grpo.loss import AGGREGATIONS, POLICY_LOSSES
from grpo.rewards import REWARDS
from grpo.trainer import GRPOTrainer

from .helpers import LORA

STEP = dict(steps=1, prompts_per_step=2, group_size=4, max_new_tokens=8, checkpoint_every=0, eval_every=0,
            warmup_steps=0, rewards={"toy_chars": 1.0}, truncated="score", rollout_backend="transformers",
            wandb_mode="disabled")
"""One step of the tiny model; a reward that differs within a group (the completion's characters:
the random model seldom ends on EOS, so its completions are scored as cut off)."""
CALLS: list[str] = []


def toy_chars(completions: list[str], answers: list[str]) -> list[float]:
    return [float(len(c)) for c in completions]


def negated_clipped(logp, old_logp, advantages, mask, *, epsilon, epsilon_high):
    """A toy policy loss: the ``clipped`` term with the opposite sign (the update runs backwards)."""
    CALLS.append("policy_loss")
    per_token, stats = POLICY_LOSSES["clipped"](logp, old_logp, advantages, mask, epsilon=epsilon,
                                                epsilon_high=epsilon_high)
    return -per_token, stats


class HalfTokenMean:
    """A toy aggregation: the token sum over half the valid tokens (twice ``dapo``'s loss); the
    normaliser is still a sum over completions."""

    @staticmethod
    def normalizer(mask, max_length):
        CALLS.append("normalizer")
        return float(mask.sum()) / 2

    @staticmethod
    def aggregate(per_token, mask, normalizer):
        CALLS.append("aggregate")
        return (per_token * mask).sum() / normalizer


class KeepNone(TokenRule):
    """A toy token-entropy rule: no token carries gradient."""

    @staticmethod
    def grad_mask(entropy, mask, threshold, cfg):
        CALLS.append("grad_mask")
        return torch.zeros_like(mask, dtype=torch.bool)

    @staticmethod
    def grad_fraction(cfg):
        return 0.0


def _one_step(model_dir, problems, out_dir, **train) -> tuple[dict, dict[str, torch.Tensor]]:
    """One training step of a fresh tiny policy (seeded: the same rollouts every call) with the
    params ``train`` over ``STEP``: the step's row and the change of every LoRA weight."""
    cfg = params_from_dict({"train": {**STEP, "output_dir": str(out_dir), **train}}).train
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(model_dir)), LoraConfig(**LORA))
    trainer = GRPOTrainer(model, load_tokenizer(model_dir), cfg, problems)
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    CALLS.clear()
    row = trainer.train_step()
    return row, {n: p.detach() - before[n] for n, p in model.named_parameters() if p.requires_grad}


@pytest.fixture(scope="module")
def toy_reward():
    with REWARDS.registered("toy_chars", toy_chars):
        yield


@pytest.fixture(scope="module")
def default_step(toy_reward, tiny_model_dir, tiny_problems, tmp_path_factory):
    """The step with the default entries (``clipped``, ``dapo``, ``high``)."""
    row, delta = _one_step(tiny_model_dir, tiny_problems, tmp_path_factory.mktemp("default"))
    assert row["kept_frac"] > 0 and row["grad_norm"] > 0
    assert any(d.abs().max() > 0 for d in delta.values())
    return row, delta


def test_a_toy_policy_loss_chosen_in_params_drives_the_update(default_step, tiny_model_dir, tiny_problems, tmp_path):
    """The negated term gives the negated gradient: AdamW's first step, sign-like, moves every LoRA
    weight by the opposite of the default step's change; the loss value is negated too."""
    with POLICY_LOSSES.registered("toy_negated", negated_clipped):
        row, delta = _one_step(tiny_model_dir, tiny_problems, tmp_path, policy_loss="toy_negated")
    assert CALLS.count("policy_loss") == 1  # one update of one micro-batch
    default_row, default_delta = default_step
    assert row["grad_norm"] == pytest.approx(default_row["grad_norm"], rel=1e-6)
    assert row["loss"] == pytest.approx(-default_row["loss"], rel=1e-5, abs=1e-9)
    for n, d in default_delta.items():
        torch.testing.assert_close(delta[n], -d, rtol=0, atol=1e-6)


def test_a_toy_aggregation_chosen_in_params_gives_the_loss(default_step, tiny_model_dir, tiny_problems, tmp_path):
    """The step's normaliser comes from the toy (once over the step) and the loss from its
    ``aggregate``: twice the default step's, so twice its gradient (the same rollouts; the norm is
    logged before clipping)."""
    with AGGREGATIONS.registered("toy_half_mean", HalfTokenMean):
        row, _ = _one_step(tiny_model_dir, tiny_problems, tmp_path, loss_type="toy_half_mean")
    assert CALLS == ["normalizer", "aggregate"]
    assert row["grad_norm"] == pytest.approx(2 * default_step[0]["grad_norm"], rel=1e-5)
    assert row["loss"] == pytest.approx(2 * default_step[0]["loss"], rel=1e-5, abs=1e-9)


def test_a_toy_token_rule_chosen_in_params_decides_the_tokens_that_learn(default_step, tiny_model_dir, tiny_problems,
                                                                        tmp_path):
    """A rule that keeps no token: its mask is asked, no token is kept, and no LoRA weight moves
    (zero gradient, so AdamW's step is zero), where the default step moved them."""
    with TOKEN_RULES.registered("toy_none", KeepNone):
        row, delta = _one_step(tiny_model_dir, tiny_problems, tmp_path, entropy_rule="toy_none")
    assert CALLS == ["grad_mask"]
    assert row["kept_frac"] == 0 and row["grad_norm"] == 0
    assert all(not d.any() for d in delta.values())

