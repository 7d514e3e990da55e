"""The policy of ``grpo.policy``: 4-bit base + LoRA, the reference as the adapter switched off, and a
clear error for a LoRA target the model does not have."""

from __future__ import annotations

import pytest
import torch

from grpo.config import LoraConfig, ModelConfig, ModelConfigError
from grpo.policy import load_policy

from .helpers import LORA, give_adapter_a_say


def test_policy_is_4bit_lora_and_reference_is_adapter_off(tiny_model_dir):
    import bitsandbytes as bnb

    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    base = model.get_base_model()
    assert isinstance(base.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    assert base.model.layers[0].mlp.up_proj.weight.quant_state.quant_type == "nf4"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # a non-zero adapter changes the output; disable_adapter gives the base model back
    give_adapter_a_say(model, std=0.5)
    ids = torch.randint(3, 90, (1, 12))
    with torch.no_grad():
        with_adapter = model(input_ids=ids).logits
        with model.disable_adapter():
            reference = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert not torch.allclose(with_adapter, reference)
    torch.testing.assert_close(with_adapter, again)


def test_unknown_lora_target_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ModelConfigError, match="lora.target_modules: .*c_attn"):
        load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(target_modules=["q_proj", "c_attn"]))


def test_export_dense_frees_the_cache_once_the_4bit_copy_is_gone(tiny_model_dir, tmp_path, monkeypatch):
    """``export_dense`` hands the device's cached memory back (``grpo.device.free_cuda_cache``) on
    the device it loaded the 4-bit base on, at a point where none of its 4-bit layers is still
    referenced (else the cache keeps them: the evaluation engine then finds the GPU memory taken)."""
    import gc

    import bitsandbytes as bnb

    import grpo.policy
    from grpo.device import default_device

    def live_4bit() -> int:
        gc.collect()
        return sum(isinstance(o, bnb.nn.Linear4bit) for o in gc.get_objects())

    before, calls = live_4bit(), []
    monkeypatch.setattr(grpo.policy, "free_cuda_cache", lambda device: calls.append((device, live_4bit())))
    out = grpo.policy.export_dense(ModelConfig(path=str(tiny_model_dir)), None, tmp_path / "dense")
    assert calls == [(default_device(), before)]
    assert out["weights"] == "dense weights (NF4 dequantised)" and (tmp_path / "dense" / "config.json").exists()
