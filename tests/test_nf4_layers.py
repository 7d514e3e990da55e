"""``grpo.model.nf4_layers``: 4-bit layers keep the standard NF4 layout, and their dense copies are exact and temporary."""

from __future__ import annotations

import pytest
import torch

from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.model.lora_policy import load_policy

from .helpers import LORA, give_adapter_a_say


def test_4bit_layers_keep_the_standard_layout_and_repacked_ones_are_refused(tiny_model_dir):
    """bitsandbytes repacks a Linear4bit into its CPU-kernel layout on an eval no-grad forward on
    CPUs with AVX512-BF16, after which dequantize_4bit is wrong: grpo.model.nf4_layers switches that off, and
    ``dense_weight`` refuses a repacked layer instead of returning wrong weights."""
    import bitsandbytes as bnb
    from bitsandbytes.functional import has_avx512bf16

    from grpo.model.lora_policy import load_training_base
    from grpo.model.nf4_layers import dense_weight

    model = load_training_base(ModelConfig(path=str(tiny_model_dir), dtype="float32"), "cpu")
    layer = next(m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit))
    assert layer.support_avx512bf16_for_cpu is False
    before = dense_weight(layer).clone()  # (out, in)
    layer.eval()
    with torch.no_grad():
        layer(torch.randn(2, layer.in_features))
    torch.testing.assert_close(dense_weight(layer), before, rtol=0, atol=0)  # still the standard layout
    if not has_avx512bf16():
        pytest.skip("no AVX512-BF16 here: bitsandbytes never repacks on this CPU")
    layer.support_avx512bf16_for_cpu = True  # bitsandbytes' own default on this CPU
    with torch.no_grad():
        layer(torch.randn(2, layer.in_features))
    with pytest.raises(RuntimeError, match="repacked"):
        dense_weight(layer)


def test_dequantized_weights_are_exact_and_temporary(tiny_model_dir):
    import bitsandbytes as bnb

    from grpo.model.nf4_layers import dequantized_weights

    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype="float32"), LoraConfig(**LORA))
    give_adapter_a_say(model, std=0.5)  # the adapter must still apply inside the block
    ids = torch.randint(3, 90, (2, 10))
    with torch.no_grad():
        before = model(input_ids=ids).logits
        with model.disable_adapter():
            base = model(input_ids=ids).logits
        with dequantized_weights(model) as patched:
            inside = model(input_ids=ids).logits  # adapter folded into the dense copy
            with model.disable_adapter():
                inside_base = model(input_ids=ids).logits
        after = model(input_ids=ids).logits
    assert not torch.allclose(base, before, atol=1e-3)  # the adapter matters
    torch.testing.assert_close(inside_base, base, rtol=1e-5, atol=1e-5)
    assert patched == sum(isinstance(m, bnb.nn.Linear4bit) for m in model.modules()) > 0
    torch.testing.assert_close(inside, before, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(after, before, rtol=0, atol=0)
    assert not any("forward" in vars(m) for m in model.modules())
