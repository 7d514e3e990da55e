"""bitsandbytes 4-bit NF4 helpers: the quantisation config, the weight layout we rely on, exact
dequantisation, and temporary dense copies of 4-bit layers for fast decoding.

This module and ``grpo.lora_policy`` are the only ones that touch bitsandbytes.
"""

from __future__ import annotations

import contextlib

import torch


def nf4_config(compute_dtype: torch.dtype):
    """bitsandbytes 4-bit NF4 with double quantisation: how training (and so evaluation) loads the base."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def keep_standard_nf4_layout(model) -> int:
    """Stop bitsandbytes (0.50) from repacking NF4 weights into its AVX512-BF16 CPU layout.

    On a CPU with AVX512-BF16, the first eval-mode forward without grad of a ``Linear4bit``
    rewrites its weight in place into a kernel-specific layout. After that,
    ``dequantize_4bit(weight, quant_state)`` returns wrong weights, which broke ``dequantized_weights``, and later training steps stopped moving the
    LoRA weights. The standard layout keeps every path exact. Returns the number of layers set.
    """
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    return len(layers)


def dense_weight(layer, dtype: torch.dtype | None = None) -> torch.Tensor:
    """The dequantised (out_features, in_features) weight of a bitsandbytes ``Linear4bit``, in
    ``dtype`` (default: the dtype it was quantised from). bitsandbytes computes the levels times
    the block scales in fp32 and casts once at the end, so ``dtype=torch.float32`` gives the exact
    dequantised values whatever the model was loaded in.

    Refuses a weight that bitsandbytes has repacked into its CPU-kernel layout, for which
    ``dequantize_4bit`` returns wrong values (``keep_standard_nf4_layout`` prevents the repack).
    """
    import copy

    import bitsandbytes as bnb

    state = layer.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        raise RuntimeError("a 4-bit layer was repacked into bitsandbytes' CPU layout, where dequantize_4bit is "
                           "wrong; load models through grpo.lora_policy (keep_standard_nf4_layout) before any forward")
    if dtype is not None and dtype != state.dtype:
        state = copy.copy(state)  # the layer's own state keeps its dtype
        state.dtype = dtype
    return bnb.functional.dequantize_4bit(layer.weight.data, state)


def dense_copy_bytes(model) -> int:
    """Bytes that ``dequantized_weights`` holds inside its block: each bitsandbytes ``Linear4bit``'s
    dense weight in its compute dtype, plus the LoRA-merged copy of each one an adapter wraps."""
    import bitsandbytes as bnb
    from peft.tuners.lora.layer import LoraLayer

    def size(layer) -> int:
        out, inp = layer.out_features, layer.in_features
        return out * inp * torch.empty((), dtype=layer.compute_dtype or torch.float32).element_size()

    quantized = {m: size(m) for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)}
    merged = sum(quantized.get(getattr(m, "base_layer", None), 0) for m in model.modules()
                 if isinstance(m, LoraLayer) and not m.merged)
    return sum(quantized.values()) + merged


@contextlib.contextmanager
def dequantized_weights(model):
    """Inside the block, every bitsandbytes ``Linear4bit`` uses a dense copy of its weight,
    dequantised once on entry, instead of dequantising at every call; where a LoRA adapter wraps
    the layer, the adapter is folded into a second copy (``W + scaling * B @ A``), so the layer is
    one matmul instead of three (the unmerged copy serves ``disable_adapter()`` blocks).

    For generation on the CPU, where bitsandbytes dequantises the whole weight for each new token,
    this trades a temporary dense copy of the quantised layers (freed on exit) for a several-fold
    faster decode. Base weights are frozen and the adapter does not change inside the block (no
    optimizer step runs there), so the copies stay exact for its duration. Returns the number of
    4-bit layers patched.
    """
    import bitsandbytes as bnb
    import torch.nn.functional as F
    from peft.tuners.lora.layer import LoraLayer

    def linear(dense, bias):
        def forward(x, *_, **__):
            return F.linear(x.to(dense.dtype), dense, None if bias is None else bias.to(dense.dtype))

        return forward

    patched, dense_of = [], {}
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            dense_of[module] = dense_weight(module).to(module.compute_dtype or torch.float32)
            module.forward = linear(dense_of[module], module.bias)
            patched.append(module)
    n_4bit = len(patched)
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(module, LoraLayer) and base in dense_of and not module.merged:
            dense = dense_of[base]
            merged = dense.clone()
            for name in module.active_adapters:
                if name in module.lora_A:
                    delta = module.lora_B[name].weight @ module.lora_A[name].weight  # (out, in)
                    merged += module.scaling[name] * delta.to(merged.dtype)
            with_adapter, without = linear(merged.detach(), base.bias), linear(dense, base.bias)

            def forward(x, *args, _m=module, _on=with_adapter, _off=without, **kwargs):
                return (_off if _m.disable_adapters else _on)(x)

            module.forward = forward
            patched.append(module)
    try:
        yield n_4bit
    finally:
        for module in patched:
            del module.forward  # back to the class's forward
