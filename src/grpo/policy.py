"""The trained policy: the frozen base (4-bit NF4 or dense) with a peft LoRA adapter.

* ``load_policy(model_cfg, lora_cfg, device)`` loads the base as training uses it (4-bit NF4 with
  double quantisation, or unquantised, in ``grpo.device.compute_dtype``), attaches LoRA and
  optionally turns gradient checkpointing on.
* The KL reference policy is the same model under ``model.disable_adapter()``: no second copy
  of the weights is ever held in memory.
* ``export_dense`` writes the policy as trained as plain dense weights for an inference engine.
"""

from __future__ import annotations

from pathlib import Path

import torch

from grpo.config import LoraConfig, ModelConfig, ModelConfigError
from grpo.device import attention_implementation, compute_dtype, default_device, free_cuda_cache
from grpo.nf4 import dense_weight, keep_standard_nf4_layout, nf4_config


def _check_target_modules(model: torch.nn.Module, targets: list[str]) -> None:
    leaf_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in leaf_names]
    if missing:
        raise ModelConfigError(f"lora.target_modules: the model has no module named {', '.join(missing)}")


def load_training_base(model_cfg: ModelConfig, device: str | torch.device = "cpu"):
    """The frozen base as training uses it: 4-bit NF4 (bitsandbytes) when ``model.quantization`` is
    ``nf4``, else dense, in ``model.dtype`` on ``device`` with ``grpo.device.attention_implementation``;
    no adapter yet."""
    from transformers import AutoModelForCausalLM

    dtype = compute_dtype(model_cfg.dtype, device)
    kwargs: dict = {"dtype": dtype, "attn_implementation": attention_implementation(device)}
    if model_cfg.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(dtype)
        kwargs["device_map"] = {"": str(device)}
    model = AutoModelForCausalLM.from_pretrained(model_cfg.path, **kwargs)
    if model_cfg.quantization != "nf4":
        model.to(device)
    keep_standard_nf4_layout(model)
    return model


def load_policy(model_cfg: ModelConfig, lora_cfg: LoraConfig, device: str | torch.device = "cpu"):
    """Load the base model (4-bit NF4 or unquantised), attach LoRA, optionally checkpoint activations.

    Returns a ``peft.PeftModel``. Only LoRA parameters have ``requires_grad``.
    """
    return attach_lora(load_training_base(model_cfg, device), lora_cfg, model_cfg.gradient_checkpointing)


def attach_lora(model, lora_cfg: LoraConfig, gradient_checkpointing: bool = True):
    """Freeze ``model``, wrap it with a peft LoRA adapter, optionally checkpoint activations."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    _check_target_modules(model, lora_cfg.target_modules)
    for p in model.parameters():
        p.requires_grad_(False)
    model.config.use_cache = False
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.enable_input_require_grads()
    peft_cfg = PeftLoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=list(lora_cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, peft_cfg)


def lm_parts(model) -> tuple[torch.nn.Module, torch.nn.Module]:
    """``(body, lm_head)`` of a (peft-wrapped) causal LM: body maps ids to final hidden states."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return base.get_decoder(), base.get_output_embeddings()


def load_base_model(path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu"):
    """The base model unquantised in eval mode (generation fallback and evaluation). ``dtype``:
    ``auto`` (``grpo.device.compute_dtype``), ``bfloat16`` or ``float32``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype(dtype, device)).to(device)
    return model.eval()


def _dequantize_linears(model: torch.nn.Module) -> None:
    """Replace every bitsandbytes 4-bit linear of ``model`` by an ``nn.Linear`` holding its
    dequantised weight (fp32, on the CPU); the 4-bit layers are dropped when this returns."""
    import bitsandbytes as bnb

    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight.data = dense_weight(child).float().cpu()
                if child.bias is not None:
                    dense.bias.data = child.bias.data.float().cpu()
                setattr(parent, name, dense)


def export_dense(model_cfg: ModelConfig, adapter_dir: str | Path | None, out_dir: str | Path) -> dict:
    """Write the policy as trained, as plain dense weights that any engine (vLLM) can load.

    The base is loaded exactly as training loads it (4-bit NF4 when ``model.quantization`` is
    ``nf4``); every 4-bit layer is replaced by a dense ``nn.Linear`` holding its dequantised weight,
    and the LoRA adapter (if any) is merged into those weights with peft's ``merge_and_unload``.
    The result computes the same function as the trained 4-bit + LoRA policy, so baseline and
    final evaluation differ by the adapter only. On CUDA the 4-bit copy is loaded on the GPU (as
    training quantises it) and its memory is given back to the driver before this returns
    (``grpo.device.free_cuda_cache``); only the process's CUDA context stays.
    """
    from transformers import AutoModelForCausalLM

    dtype = torch.float32
    kwargs: dict = {"dtype": dtype}
    device = default_device()
    if model_cfg.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(dtype)
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(model_cfg.path, **kwargs)
    _dequantize_linears(model)
    model = model.cpu()
    # The NF4 copy on the GPU is gone; give its cached blocks back, or the engine that starts next
    # (another process for evaluation) finds them taken: vLLM refuses to start when free memory is
    # below gpu_memory_utilization x total (docs/gpu-notes.md#engine-memory).
    free_cuda_cache(device)
    model.hf_quantizer = None
    model.is_loaded_in_4bit = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    how = "dense weights (NF4 dequantised)" if model_cfg.quantization == "nf4" else "dense weights"
    if adapter_dir is not None:
        from peft import PeftModel

        if not (Path(adapter_dir) / "adapter_config.json").exists():
            raise ModelConfigError(f"{adapter_dir}: no adapter_config.json (run the train stage first)")
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
        how += " + LoRA merged"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_cfg.path).save_pretrained(out_dir)
    return {"weights": how, "path": str(out_dir)}
