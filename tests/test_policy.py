"""The policy of ``grpo.policy``: 4-bit base + LoRA, the reference as the adapter switched off, and a
clear error for a LoRA target the model does not have."""

from __future__ import annotations

import pytest
import torch

from grpo.config import LoraConfig, ModelConfig, ModelConfigError
from grpo.policy import load_policy

from .helpers import LORA


def test_policy_is_4bit_lora_and_reference_is_adapter_off(tiny_model_dir):
    import bitsandbytes as bnb

    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    base = model.get_base_model()
    assert isinstance(base.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    assert base.model.layers[0].mlp.up_proj.weight.quant_state.quant_type == "nf4"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # a non-zero adapter changes the output; disable_adapter gives the base model back
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.5)
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
