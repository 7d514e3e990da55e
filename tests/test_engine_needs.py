"""What an engine needs on CUDA (``grpo.rollout.engine.needs``): the parts by hand on the tiny model, the
train engine's form for ``auto`` on seed 003's shapes, and ``form_here``, the train stage's
resolution on this machine, which reads only the prepared model and the card, and only where
``auto`` has more than one form to choose from."""

from __future__ import annotations

import math

import pytest

from grpo.config.params import params_from_dict
from grpo.core.model_shapes import prepared_shapes
from grpo.rollout.engine import needs
from grpo.rollout.engine.forms import lora_buffer_bytes
from grpo.rollout.engine.forms_catalogue import WEIGHTS_FORMS
from grpo.tools import memory
from grpo.tools.cli import resolve_params
from grpo.training.trainer_builder import depart

from .conftest import REPO


def _preset(name: str):
    return resolve_params(REPO / "presets" / f"{name}.yaml").params


def test_engine_terms_of_the_tiny_model_by_hand(tiny_model_dir):
    """The engine's parts from the tiny Llama's real config (2 layers, hidden 64, 4 heads / 2 KV heads of
    16, intermediate 128), each worked out by hand; the KV bytes per token against the live engine:
    tests/test_engine_policy_engine.py::test_the_engine_is_bounded_to_one_step."""
    shapes = prepared_shapes(tiny_model_dir)
    assert needs.kv_bytes_per_token(shapes, 2) == 2 * 2 * 2 * 16 * 2  # K and V x layers x kv heads x head dim x B
    # vLLM's LoRA buffers: rank 4 -> max_lora_rank 8; (in + out) of q, k, v, o, gate, up, down = 1024 per layer
    assert lora_buffer_bytes(shapes, 4, 2) == 8 * 2 * 1024 * 2
    dense, nf4 = WEIGHTS_FORMS["dense"].needs(shapes, 4, 2, "bfloat16"), WEIGHTS_FORMS["nf4"].needs(shapes, 4, 2, "bfloat16")
    assert (dense.weights, dense.lora, dense.dequant) == (shapes.total_params * 2, 0, 0)
    # the nf4 engine holds the norms only: 2 per layer and the final one; vLLM's LoRA buffers; one 4-bit layer
    # dequantised (the largest: gate/up/down, 64 x 128)
    assert (nf4.weights, nf4.lora, nf4.dequant) == ((2 * shapes.layers + 1) * shapes.hidden * 2, 8 * 2 * 1024 * 2,
                                                    64 * 128 * 2)
    # one call of 8 completions of 20 + 7 tokens: 2 blocks of 16 each; at least one max_model_len sequence
    assert needs.engine_step_tokens(8, 20, 7, 256) == 8 * 32
    assert needs.engine_step_tokens(2, 20, 7, 1024) == 1024
    forward, sampler = needs.engine_profile_bytes(shapes, 40, 8, 2)
    assert forward == 40 * (2 * 64 + 3 * 128) * 2 and sampler == 40 * 64 * 2 + 8 * shapes.vocab * (2 + 25)


def test_auto_engine_weights_are_dense_where_they_fit_the_budget():
    """Seed 003 (KV 28 KiB a token, 16 completions x 640 tokens a step): the dense engine needs about
    3.95 GiB, so at gpu_memory_utilization 0.12 of 8 GiB (0.96 GiB) auto picks the nf4 engine, at 0.6
    (4.8 GiB) the dense one; a CPU and an unknown card get dense; an explicit choice stays."""
    params = _preset("seed003")
    shapes = memory.resolve_shapes(params.model, REPO)
    card = 8 * 2**30
    assert needs.kv_bytes_per_token(shapes, 2) == 28 * 1024
    plan = needs.engine_plan(params, shapes, "cuda", 128, card)
    assert (plan.form, plan.seqs, plan.step_tokens) == ("nf4", 16, 16 * 640)
    assert plan.why.startswith("auto: dense needs 3.9") and "> the budget 0.96 GiB" in plan.why
    assert plan.need < plan.budget == math.ceil(0.12 * card)
    roomy = depart(params, {"train.rollouts.gpu_memory_utilization": 0.6})
    assert needs.choose_engine_form(roomy, shapes, "cuda", 128, card)[0] == "dense"
    assert needs.choose_engine_form(params, shapes, "cpu", 128, None)[0] == "dense"
    form, why = needs.choose_engine_form(params, shapes, "cuda", 128, None)
    assert form == "dense" and "no card given" in why and "on cards from 32.9" in why
    dense = depart(params, {"train.rollouts.engine_weights": "dense"})
    assert needs.choose_engine_form(dense, shapes, "cuda", 128, card) == ("dense", "train.rollouts.engine_weights")
    unquantized = params.model_copy(update={"model": params.model.model_copy(update={"quantization": "none"})})
    assert needs.choose_engine_form(unquantized, shapes, "cuda", 128, card)[0] == "dense"


def test_form_here_looks_nothing_up_where_no_budget_decides(tmp_path, monkeypatch):
    """On a CPU, for an explicit choice, or with one usable form, the form is known without the
    model's shapes, the prompts or the card (none of them exists here)."""
    import torch

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: pytest.fail("the card was asked"))
    params = params_from_dict({"model": {"path": "models/absent"}})
    assert needs.form_here(params, tmp_path, "cpu") == ("dense", "auto: dense on a CPU")
    nf4 = params_from_dict({"model": {"path": "models/absent"}, "train": {"rollouts": {"engine_weights": "nf4"}}})
    assert needs.form_here(nf4, tmp_path, "cuda") == ("nf4", "train.rollouts.engine_weights")
    plain = params_from_dict({"model": {"path": "models/absent", "quantization": "none"}})
    assert needs.form_here(plain, tmp_path, "cuda") == (
        "dense", "auto: dense (model.quantization none: no 4-bit base to share)")
    assert not needs.decided_by_needs(plain, "cuda") and needs.decided_by_needs(params, "cuda:1")


def test_form_here_reads_the_prepared_model_and_this_card(tiny_model_dir, tmp_path, monkeypatch):
    """``auto`` on CUDA: the shapes of ``model.path``'s config.json (no synthetic fallback: a model
    not prepared is one line naming the file), the prompt ``max_model_len - max_new_tokens`` where
    no prepared rows exist, the card's total memory; the same answer ``choose_engine_form`` gives."""
    import torch

    params = params_from_dict({"model": {"path": str(tiny_model_dir)}, "train": {"rollouts": {"gpu_memory_utilization": 0.5}}})
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (0, 8 * 2**30))
    prompt = params.train.rollouts.max_model_len - params.train.rollouts.max_new_tokens
    expected = needs.choose_engine_form(params, prepared_shapes(tiny_model_dir), "cuda", prompt, 8 * 2**30)
    assert needs.form_here(params, tmp_path, "cuda") == expected
    assert expected[0] == "dense" and expected[1].startswith("auto: dense needs ") and "<= the budget 4.00 GiB" in expected[1]
    absent = params_from_dict({"model": {"path": "models/base"}})
    with pytest.raises(FileNotFoundError, match=r"models/base/config.json: no such file.*run prepare_model first"):
        needs.form_here(absent, tmp_path, "cuda")


def test_the_other_forms_plans_advise_a_leaner_one():
    """Seed 003 with a dense engine on 5 GiB: the nf4 plan is the other usable form's, and the
    verdict names it; without the 4-bit base there is no other form."""
    params = _preset("seed003")
    dense = depart(params, {"train.rollouts.engine_weights": "dense"})
    shapes = memory.resolve_shapes(params.model, REPO)
    plan = needs.engine_plan(dense, shapes, "cuda", 128, 5 * 2**30)
    assert [p.form for p in needs.other_plans(dense, shapes, "cuda", 128, plan)] == ["nf4"]
    plain = dense.model_copy(update={"model": dense.model.model_copy(update={"quantization": "none"})})
    assert needs.other_plans(plain, shapes, "cuda", 128, plan) == []
