"""bitsandbytes 4-bit NF4 helpers: the quantisation config, the weight layout we rely on, exact
dequantisation, and temporary dense copies of 4-bit layers for fast decoding.

This module and ``grpo.model.lora_policy`` are the only ones that touch bitsandbytes.
"""

from __future__ import annotations

import contextlib
import weakref
from dataclasses import dataclass

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
                           "wrong; load models through grpo.model.lora_policy (keep_standard_nf4_layout) before any forward")
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


_PERSISTENT: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> its ``DenseLayer`` list, kept by ``dequantized_weights(persistent=True)``."""


@dataclass
class DenseLayer:
    """One patched layer of ``dequantized_weights``: a ``Linear4bit`` (``quantized``) with its dense
    copy, or a LoRA layer over one with the adapter folded into a second copy; ``forward`` the
    patched forward, ``refill`` recomputes the copy in place (the weights it reads may have moved)."""

    module: torch.nn.Module
    forward: object
    refill: object
    quantized: bool


def _dense_linear(dense: torch.Tensor, bias):
    import torch.nn.functional as F

    def forward(x, *_, **__):
        return F.linear(x.to(dense.dtype), dense, None if bias is None else bias.to(dense.dtype))

    return forward


def _fold_adapter(module, dense: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """``out`` (in place) = ``dense`` + each active adapter's ``scaling * B @ A``."""
    out.copy_(dense)
    for name in module.active_adapters:
        if name in module.lora_A:
            delta = module.lora_B[name].weight @ module.lora_A[name].weight  # (out, in)
            out += module.scaling[name] * delta.to(out.dtype).detach()
    return out


def _dense_layers(model, static: bool) -> list[DenseLayer]:
    """The ``DenseLayer`` of every 4-bit layer of ``model`` and of every unmerged LoRA layer over
    one; ``static``: their copies marked as static addresses for a compiled step."""
    import bitsandbytes as bnb
    from peft.tuners.lora.layer import LoraLayer

    def mark(t: torch.Tensor) -> torch.Tensor:
        if static:
            torch._dynamo.mark_static_address(t)
        return t

    layers, dense_of = [], {}
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            dense = mark(dense_weight(module).to(module.compute_dtype or torch.float32))
            dense_of[module] = dense

            def refill(_m=module, _d=dense):
                _d.copy_(dense_weight(_m).to(_d.dtype))

            layers.append(DenseLayer(module, _dense_linear(dense, module.bias), refill, True))
    for module in model.modules():
        base = getattr(module, "base_layer", None)
        if isinstance(module, LoraLayer) and base in dense_of and not module.merged:
            dense = dense_of[base]
            merged = mark(_fold_adapter(module, dense, torch.empty_like(dense)))
            on, off = _dense_linear(merged, base.bias), _dense_linear(dense, base.bias)

            def forward(x, *args, _m=module, _on=on, _off=off, **kwargs):
                return (_off if _m.disable_adapters else _on)(x)

            def refill(_m=module, _d=dense, _o=merged):
                _fold_adapter(_m, _d, _o)

            layers.append(DenseLayer(module, forward, refill, False))
    return layers


def holds_dense_copies(model) -> bool:
    """Whether ``dequantized_weights(model, persistent=True)`` keeps copies of ``model``."""
    return model in _PERSISTENT


@contextlib.contextmanager
def dequantized_weights(model, persistent: bool = False):
    """Inside the block, every bitsandbytes ``Linear4bit`` uses a dense copy of its weight,
    dequantised once on entry, instead of dequantising at every call; where a LoRA adapter wraps
    the layer, the adapter is folded into a second copy (``W + scaling * B @ A``), so the layer is
    one matmul instead of three (the unmerged copy serves ``disable_adapter()`` blocks).

    For generation on the CPU, where bitsandbytes dequantises the whole weight for each new token,
    this trades a temporary dense copy of the quantised layers (freed on exit) for a several-fold
    faster decode. Base weights are frozen and the adapter does not change inside the block (no
    optimizer step runs there), so the copies stay exact for its duration. Returns the number of
    4-bit layers patched.

    ``persistent``: the copies and the patched forwards are made once per model and kept after the
    block (``dense_copy_bytes`` stay allocated); each entry refills the copies in place. A compiled
    decode step needs this: it captured their addresses (marked static, as transformers marks its
    static cache) and the forwards' identity, which new copies would change (a recompile per call);
    never run on a GPU (docs/gpu-notes.md, "The `decode` section").
    """
    layers = _PERSISTENT.get(model) if persistent else None
    if layers is None:
        layers = _dense_layers(model, static=persistent)
        if persistent:
            _PERSISTENT[model] = layers
    else:
        for layer in layers:
            layer.refill()
    for layer in layers:
        layer.module.forward = layer.forward
    try:
        yield sum(layer.quantized for layer in layers)
    finally:
        for layer in layers:
            del layer.module.forward  # back to the class's forward
