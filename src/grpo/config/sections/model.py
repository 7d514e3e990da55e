"""The ``model`` section: the base model, where it lives, its weights form and dtype."""

from __future__ import annotations

from typing import ClassVar, Literal

from grpo.core.fields import Dtype, Section


class ModelConfig(Section):
    SECTION: ClassVar[str] = "model"
    name: str = "smollm2-135m-instruct"
    """``smollm2-135m-instruct`` (offline default), a local directory, or a hub id."""
    path: str = "models/base"
    """Where prepare_model writes the Hugging Face directory that later stages load."""
    quantization: Literal["nf4", "none"] = "nf4"
    """``nf4``: bitsandbytes 4-bit NF4 with double quantisation; ``none``: weights in ``dtype``."""
    dtype: Dtype = "auto"
    """Compute dtype: ``bfloat16``, ``float16``, ``float32``, or ``auto`` (``grpo.core.device.compute_dtype``:
    bf16 on GPUs of compute capability 8.0 or newer, fp16 on older GPUs, where vLLM refuses bf16;
    bf16 on CPUs with native bf16 instructions, fp32 on other CPUs)."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in backward instead of storing them."""
