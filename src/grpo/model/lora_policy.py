"""The trained policy: the frozen base (4-bit NF4 or dense) with a peft LoRA adapter.

* ``load_policy(model_cfg, lora_cfg, device)`` loads the base as training uses it (4-bit NF4 with
  double quantisation, or unquantised, in ``grpo.core.device.compute_dtype``), attaches LoRA and
  optionally turns gradient checkpointing on.
* The KL reference policy is the same model under ``model.disable_adapter()``: no second copy
  of the weights is ever held in memory.
* ``export_dense`` writes the policy as trained as plain dense weights for an inference engine,
  shard by shard in the engine's dtype.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo.core.device import (
    attention_implementation,
    compute_dtype,
    default_device,
    free_cuda_cache,
    refuse_half_overflow,
)
from grpo.core.errors import ModelConfigError
from grpo.model.nf4_layers import dense_weight, keep_standard_nf4_layout, nf4_config

if TYPE_CHECKING:  # sections are the config layer's, above this one: the callers hand them in
    from grpo.config.sections.lora import LoraConfig
    from grpo.config.sections.model import ModelConfig


def _check_target_modules(model: torch.nn.Module, targets: list[str]) -> None:
    leaf_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in leaf_names]
    if missing:
        raise ModelConfigError(f"lora.target_modules: the model has no module named {', '.join(missing)}")


def load_training_base(model_cfg: ModelConfig, device: str | torch.device = "cpu"):
    """The frozen base as training uses it: 4-bit NF4 (bitsandbytes) when ``model.quantization`` is
    ``nf4``, else dense, in ``model.dtype`` on ``device`` with ``grpo.core.device.attention_implementation``;
    no adapter yet. On CUDA the blocks the load leaves cached (the 16-bit weights before they were
    quantised) go back to the driver, so that an engine started next finds them free."""
    from transformers import AutoModelForCausalLM

    dtype = compute_dtype(model_cfg.dtype, device)
    refuse_half_overflow(model_cfg.path, dtype)
    kwargs: dict = {"dtype": dtype, "attn_implementation": attention_implementation(device)}
    if model_cfg.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(dtype)
        kwargs["device_map"] = {"": str(device)}
    model = AutoModelForCausalLM.from_pretrained(model_cfg.path, **kwargs)
    if model_cfg.quantization != "nf4":
        model.to(device)
    keep_standard_nf4_layout(model)
    free_cuda_cache(device)
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
    ``auto`` (``grpo.core.device.compute_dtype``), ``bfloat16`` or ``float32``."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=compute_dtype(dtype, device)).to(device)
    return model.eval()


EXPORT_SHARD_BYTES = 1 << 30
"""Largest safetensors shard ``export_dense`` writes (bytes); a tensor larger than this gets its own."""


def _export_plan(model) -> list[tuple[str, torch.nn.Parameter | torch.Tensor, torch.nn.Module | None]]:
    """``(name, tensor, 4-bit layer or None)`` for every tensor of ``model``'s checkpoint, in module
    order: parameters once each (a tied head is the embedding's, as ``save_pretrained`` writes it)
    and persistent buffers; a 4-bit layer's packed weight stands for its dequantised weight."""
    import bitsandbytes as bnb

    owner = {id(m.weight): m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)}
    plan = [(name, p, owner.get(id(p))) for name, p in model.named_parameters()]
    for name, buf in model.named_buffers():
        module_name, _, leaf = name.rpartition(".")
        if leaf not in model.get_submodule(module_name)._non_persistent_buffers_set:
            plan.append((name, buf, None))
    return plan


def _plan_shards(sizes: list[int], max_bytes: int) -> list[list[int]]:
    """Consecutive tensors (by index) grouped into shards of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[int]] = [[]]
    used = 0
    for i, size in enumerate(sizes):
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += size
    return shards


_LORA_TENSOR = re.compile(r"base_model\.model\.(.+)\.lora_([AB])(?:\.[^.]+)?\.weight")


def _tensor_shapes(files: list[Path]) -> dict[str, list[int]]:
    """``{name: shape}`` of the tensors in safetensors ``files`` (headers only, no tensor is read)."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in files:
        with safe_open(str(file), "pt") as fh:
            shapes.update({k: list(fh.get_slice(k).get_shape()) for k in fh.keys()})
    return shapes


def _adapter_config(adapter_dir: Path) -> dict:
    """The adapter's adapter_config.json; ``ModelConfigError`` when missing or not JSON."""
    file = adapter_dir / "adapter_config.json"
    if not file.is_file():
        raise ModelConfigError(f"{adapter_dir}: no adapter_config.json (run the train stage first)")
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise ModelConfigError(f"{file}: not JSON ({err})") from None


def check_adapter(adapter_dir: str | Path, base_path: str | Path) -> None:
    """Refuse, before anything is loaded, a LoRA adapter that does not fit the base at ``base_path``,
    with a ``ModelConfigError`` of one line naming the adapter (its rank, target modules and the
    base it was trained on) and the base: weights of another rank than its config's ``r``, a
    target module the base has none of, or a LoRA matrix whose width is not that of the base
    weight it adds to (another base). Reads only adapter_config.json and the safetensors headers
    (the base's too; a base without safetensors files is checked no further than its config)."""
    adapter_dir, base_path = Path(adapter_dir), Path(base_path)
    cfg = _adapter_config(adapter_dir)
    rank, targets = cfg.get("r"), sorted(cfg.get("target_modules") or [])
    who = f"{adapter_dir} (rank {rank} on {', '.join(targets)}, trained on {cfg.get('base_model_name_or_path')})"
    weights = sorted(adapter_dir.glob("*.safetensors"))
    if not weights:
        raise ModelConfigError(f"{who}: no adapter_model.safetensors")
    base = _tensor_shapes(sorted(base_path.glob("*.safetensors")))
    leaves = {name.rsplit(".", 2)[-2] for name in base if name.endswith(".weight") and "." in name}
    missing = [t for t in targets if base and t not in leaves]
    if missing:
        raise ModelConfigError(f"{who} does not fit the base {base_path}: it has no module named {', '.join(missing)}")
    for name, shape in _tensor_shapes(weights).items():
        match = _LORA_TENSOR.fullmatch(name)
        if match is None or len(shape) != 2:
            continue
        module, which = match.groups()
        r = shape[0] if which == "A" else shape[1]  # lora_A: [r, in], lora_B: [out, r]
        if r != rank and not cfg.get("rank_pattern"):
            raise ModelConfigError(f"{who}: its weights have rank {r} ({name}), its adapter_config.json says "
                                   f"{rank}: the files come from two adapters; train it again")
        target = base.get(f"{module}.weight")
        width = shape[1] if which == "A" else shape[0]
        if target is not None and width != target[1 if which == "A" else 0]:
            side = "input" if which == "A" else "output"
            raise ModelConfigError(f"{who} does not fit the base {base_path}: {module} has {target[1 if which == 'A' else 0]} "
                                   f"{side} features there, {width} in the adapter")


def _load_for_export(model_cfg: ModelConfig, adapter_dir: str | Path | None, dtype: torch.dtype, device: str):
    """The base loaded as training loads it (NF4 in ``dtype``), its export plan (``_export_plan``),
    and ``id(base weight) -> the peft LoRA layer over it`` when ``adapter_dir`` is given."""
    from transformers import AutoModelForCausalLM

    kwargs: dict = {"dtype": dtype}
    if model_cfg.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(dtype)
        kwargs["device_map"] = {"": device}
    model = AutoModelForCausalLM.from_pretrained(model_cfg.path, **kwargs)
    keep_standard_nf4_layout(model)
    plan = _export_plan(model)  # before peft wraps the layers: the checkpoint's own names
    lora: dict[int, object] = {}
    if adapter_dir is not None:
        from peft import PeftModel
        from peft.tuners.lora.layer import LoraLayer

        wrapped = PeftModel.from_pretrained(model, str(adapter_dir))
        lora = {id(m.get_base_layer().weight): m for m in wrapped.modules() if isinstance(m, LoraLayer)}
    return model, plan, lora


@torch.no_grad()
def _dense(tensor, layer, merge, dtype: torch.dtype) -> torch.Tensor:
    """The tensor as the engine gets it: fp32 dequantised (a 4-bit ``layer``'s weight) plus the
    merged adapter (``merge``: the peft LoRA layer over it, or None), cast once to ``dtype`` (as
    peft's merge_and_unload on fp32 weights, then the engine's cast); other tensors as they are."""
    if not tensor.is_floating_point() and layer is None:
        return tensor.cpu()
    if layer is None and merge is None:
        return tensor.detach().to(dtype).cpu().contiguous()
    w = dense_weight(layer, torch.float32) if layer is not None else tensor.detach().float()
    if merge is not None:
        for name in merge.active_adapters:
            if name in merge.lora_A:
                w = w + merge.get_delta_weight(name).float()
    return w.to(dtype).cpu().contiguous()


def _export_bytes(tensor, layer, dtype: torch.dtype) -> int:
    """Bytes of the tensor in the export (a 4-bit layer's weight at its dequantised shape)."""
    if not tensor.is_floating_point() and layer is None:
        return tensor.numel() * tensor.element_size()
    shape = layer.weight.quant_state.shape if layer is not None else tensor.shape
    return torch.Size(shape).numel() * dtype.itemsize


def _write_dense_shards(model_cfg: ModelConfig, adapter_dir: str | Path | None, out_dir: Path, dtype: torch.dtype,
                        device: str, max_shard_bytes: int) -> list[str]:
    """Load the base as training does, then write every tensor dense in ``dtype``, one shard at a
    time (``export_dense``); returns the files written. Every reference to the loaded model dies
    with this call, so the caller can give the device's cached memory back."""
    from safetensors.torch import save_file

    model, plan, lora = _load_for_export(model_cfg, adapter_dir, dtype, device)
    sizes = [_export_bytes(t, layer, dtype) for _, t, layer in plan]
    shards = _plan_shards(sizes, max_shard_bytes)
    names = (["model.safetensors"] if len(shards) == 1 else
             [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))])
    for stale in [*out_dir.glob("*.safetensors"), out_dir / "model.safetensors.index.json"]:
        stale.unlink(missing_ok=True)  # an older export's shards would be loaded beside these
    weight_map = {}
    for file, members in zip(names, shards):
        tensors = {plan[i][0]: _dense(plan[i][1], plan[i][2], lora.get(id(plan[i][1])), dtype) for i in members}
        weight_map.update(dict.fromkeys(tensors, file))
        save_file(tensors, out_dir / file, metadata={"format": "pt"})
        del tensors  # only one shard's tensors are ever held
    if len(shards) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    config.save_pretrained(out_dir)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(out_dir)
    return names


def export_dense(model_cfg: ModelConfig, adapter_dir: str | Path | None, out_dir: str | Path, *,
                 dtype: torch.dtype | None = None, max_shard_bytes: int = EXPORT_SHARD_BYTES) -> dict:
    """Write the policy as trained, as plain dense weights that any engine (vLLM) can load.

    An adapter is checked against the base first (``check_adapter``). The base is loaded exactly as training loads it (4-bit NF4 when ``model.quantization`` is
    ``nf4``, on the default device). Tensor by tensor, each 4-bit layer's weight is dequantised in
    fp32, the LoRA adapter (if any) is merged into it (peft's ``get_delta_weight``, the update
    ``merge_and_unload`` adds) and the result cast once to ``dtype``: the engine's dtype, by default
    ``grpo.core.device.compute_dtype(model.dtype)`` (bf16 or fp16 on CUDA; on CPUs bf16 with native bf16
    instructions, else fp32). The result computes the same function as the trained 4-bit + LoRA
    policy, so baseline and final evaluation differ by the adapter only; an engine of that dtype
    holds the very values it held when this wrote fp32 and the engine cast them.

    Written in Hugging Face's sharded layout (``model-0000i-of-0000n.safetensors`` of at most
    ``max_shard_bytes`` each plus ``model.safetensors.index.json``; one ``model.safetensors`` where
    it fits), config, generation config and tokenizer. Only one shard's dense tensors are in memory
    at a time, beside the 4-bit model (on the GPU on CUDA). On CUDA the 4-bit copy's memory is given
    back to the driver before this returns (``grpo.core.device.free_cuda_cache``); only the process's
    CUDA context stays.
    """
    device = default_device()
    dtype = dtype or compute_dtype(model_cfg.dtype, device)
    if adapter_dir is not None:
        check_adapter(adapter_dir, model_cfg.path)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    files = _write_dense_shards(model_cfg, adapter_dir, out_dir, dtype, device, max_shard_bytes)
    # The NF4 copy on the GPU is gone; give its cached blocks back, or the engine that starts next
    # (another process for evaluation) finds them taken: vLLM refuses to start when free memory is
    # below gpu_memory_utilization x total (docs/gpu-notes.md#engine-memory).
    free_cuda_cache(device)
    from transformers import AutoTokenizer

    AutoTokenizer.from_pretrained(model_cfg.path).save_pretrained(out_dir)
    how = "dense weights (NF4 dequantised)" if model_cfg.quantization == "nf4" else "dense weights"
    if adapter_dir is not None:
        how += " + LoRA merged"
    return {"weights": how, "path": str(out_dir), "dtype": str(dtype).removeprefix("torch."), "files": files}
