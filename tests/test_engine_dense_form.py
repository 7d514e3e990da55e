"""The ``dense`` sync's weights (``grpo.rollout.engine.dense_form``): ``PolicyWeights.fused()`` is ``W + (alpha / r) B A``
for every adapted layer, stacked into vLLM's fused parameters in order (q, k, v -> qkv_proj; gate, up ->
gate_up_proj), with the current adapter and the engine's dtype; ``write_into`` copies them into a module
tree named as vLLM's and refuses a missing module or a shape that differs (no vLLM needed: the engine
side is a plain torch module here; the real engine: tests/test_engine_policy_engine.py)."""

from __future__ import annotations

import pytest
import torch

from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.model.lora_policy import load_policy
from grpo.rollout.engine.dense_form import PolicyWeights, write_into

from .helpers import randomise_adapter, tiny_engine_policy

ATTN = "model.layers.{}.self_attn"
MLP = "model.layers.{}.mlp"


def _merged(layer) -> torch.Tensor:
    """(out, in) ``W + scaling * B @ A`` of one peft LoRA layer over a dense base, by hand."""
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight  # (r, in), (out, r)
    return layer.base_layer.weight + layer.scaling["default"] * (b @ a)


def test_fused_weights_of_a_dense_base_by_hand(tiny_model_dir):
    """A dense fp32 base with LoRA on q, v and up (random B): each layer's ``qkv_proj`` is
    [Wq + s Bq Aq; Wk; Wv + s Bv Av] (k's base rows in the middle, unadapted), its ``gate_up_proj``
    [Wg; Wu + s Bu Au], scaling alpha / r = 2; the layers without an adapter are not synced."""
    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), quantization="none", dtype="float32"),
                        LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]))
    randomise_adapter(model, std=0.1, seed=3)
    fused = PolicyWeights(model, torch.float32).fused()
    assert sorted(fused) == sorted(f"{p.format(i)}.{m}" for i in (0, 1)
                                   for p, m in ((ATTN, "qkv_proj"), (MLP, "gate_up_proj")))
    layers = model.get_base_model().model.layers
    for i, layer in enumerate(layers):
        attn, mlp = layer.self_attn, layer.mlp
        assert attn.q_proj.scaling["default"] == 2.0
        with torch.no_grad():
            qkv = torch.cat([_merged(attn.q_proj), attn.k_proj.weight, _merged(attn.v_proj)])  # (64 + 32 + 32, 64)
            gate_up = torch.cat([mlp.gate_proj.weight, _merged(mlp.up_proj)])  # (128 + 128, 64)
        assert fused[f"{ATTN.format(i)}.qkv_proj"].shape == (128, 64)
        torch.testing.assert_close(fused[f"{ATTN.format(i)}.qkv_proj"], qkv, rtol=0, atol=1e-6)
        torch.testing.assert_close(fused[f"{MLP.format(i)}.gate_up_proj"], gate_up, rtol=0, atol=1e-6)
        assert (attn.q_proj.lora_B["default"].weight != 0).any()  # the adapter has a say


def test_fused_weights_of_the_4bit_policy_are_what_its_layers_compute(tiny_model_dir):
    """The engine tests' policy (NF4 base, LoRA on q, k, v, o, random B): each fused weight, applied
    to the identity, gives what the policy's own (unmerged) layers give; they follow the adapter as it
    changes (the base is dequantised once); the engine's dtype is the one asked for."""
    _, model, _ = tiny_engine_policy(tiny_model_dir)
    randomise_adapter(model, std=0.1, seed=5)
    weights = PolicyWeights(model, torch.float32)
    fused = weights.fused()
    assert sorted(fused) == sorted(f"{ATTN.format(i)}.{m}" for i in (0, 1) for m in ("qkv_proj", "o_proj"))
    attn = model.get_base_model().model.layers[0].self_attn
    eye = torch.eye(64)
    with torch.no_grad():
        own = torch.cat([attn.q_proj(eye), attn.k_proj(eye), attn.v_proj(eye)], dim=1).T  # (128, 64)
        torch.testing.assert_close(fused[f"{ATTN.format(0)}.qkv_proj"], own, rtol=0, atol=1e-5)
        torch.testing.assert_close(fused[f"{ATTN.format(0)}.o_proj"], attn.o_proj(eye).T, rtol=0, atol=1e-5)
        attn.k_proj.lora_B["default"].weight.mul_(-1.0)  # an optimizer step, say
        moved = weights.fused()[f"{ATTN.format(0)}.qkv_proj"]
        torch.testing.assert_close(moved, torch.cat([attn.q_proj(eye), attn.k_proj(eye), attn.v_proj(eye)], 1).T,
                                   rtol=0, atol=1e-5)
    assert not torch.equal(moved[64:96], own[64:96]) and torch.equal(moved[:64], own[:64])
    assert PolicyWeights(model, torch.bfloat16).fused()[f"{ATTN.format(0)}.o_proj"].dtype == torch.bfloat16


def test_fused_refuses_a_disabled_adapter(tiny_model_dir):
    _, model, _ = tiny_engine_policy(tiny_model_dir)
    weights = PolicyWeights(model, torch.float32)
    with model.disable_adapter(), pytest.raises(RuntimeError, match="merged or disabled"):
        weights.fused()


def _engine_tree() -> torch.nn.Module:
    """Modules named as vLLM's Llama: ``model.layers.0.self_attn.qkv_proj`` (6 x 4) and ``o_proj`` (4 x 4),
    in bfloat16 (the engine's dtype, not the policy's)."""
    root = torch.nn.Module()
    root.model = torch.nn.Module()
    root.model.layers = torch.nn.ModuleList([torch.nn.Module()])
    attn = root.model.layers[0].self_attn = torch.nn.Module()
    attn.qkv_proj = torch.nn.Linear(4, 6, bias=False, dtype=torch.bfloat16)
    attn.o_proj = torch.nn.Linear(4, 4, bias=False, dtype=torch.bfloat16)
    return root


def test_write_into_copies_into_the_engines_parameters():
    """The values land in the existing parameters (the same objects, the engine's dtype); a layer
    not named is left alone; the count of layers written comes back."""
    engine = _engine_tree()
    attn = engine.model.layers[0].self_attn
    param, o_before = attn.qkv_proj.weight, attn.o_proj.weight.detach().clone()
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4) / 8  # exact in bfloat16
    assert write_into(engine, {f"{ATTN.format(0)}.qkv_proj": w}) == 1
    assert attn.qkv_proj.weight is param and param.dtype == torch.bfloat16
    assert torch.equal(param.float(), w) and torch.equal(attn.o_proj.weight, o_before)


def test_write_into_refuses_a_missing_module_or_another_shape():
    engine = _engine_tree()
    with pytest.raises(KeyError, match=r"model\.layers\.0\.mlp\.gate_up_proj"):
        write_into(engine, {f"{MLP.format(0)}.gate_up_proj": torch.zeros(8, 4)})
    with pytest.raises(KeyError, match=r"model\.layers\.1\.self_attn\.qkv_proj"):
        write_into(engine, {f"{ATTN.format(1)}.qkv_proj": torch.zeros(6, 4)})
    with pytest.raises(ValueError, match=r"qkv_proj: engine weight \(6, 4\) vs policy \(4, 6\)"):
        write_into(engine, {f"{ATTN.format(0)}.qkv_proj": torch.zeros(4, 6)})
