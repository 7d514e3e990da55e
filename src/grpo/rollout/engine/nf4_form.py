"""The ``nf4`` weights form: a vLLM engine that computes with the trainer's own 4-bit weights.

``NF4Form`` (registered as ``nf4``; the contract: ``grpo.rollout.engine.forms.WeightsForm``) owns it: the
engine's folder (``write_engine_folder``), its arguments (vLLM's LoRA support at the policy's rank,
``enforce_eager`` always: bitsandbytes' calls are not captured), its start (``register``, then the
engine built inside ``sharing(policy)``), the sync (``grpo.rollout.engine.adapter.AdapterSync``), its rule
on the params (it needs ``model.quantization: nf4``) and its memory (the norms, vLLM's LoRA
buffers and the largest 4-bit layer dequantised for a long forward).

The engine holds no weights of its own beyond the norms. It is built in the training process
(vLLM's ``uni`` or ``external_launcher`` executor) inside ``sharing(policy)``, with a quantization
method of ours registered with vLLM (``register``; vLLM's out-of-tree API,
``register_quantization_config``) and named in the engine folder's ``config.json``
(``write_engine_folder``). vLLM asks the method for every layer it builds (``get_quant_method``):

- a linear layer (``LinearBase``): ``SharedLinearMethod`` holds the trainer's bitsandbytes
  ``Linear4bit`` modules of that layer (one for ``o_proj``; the parts of vLLM's merged layers
  through vLLM's ``packed_modules_mapping``: ``qkv_proj`` -> ``q_proj``, ``k_proj``, ``v_proj``;
  ``gate_up_proj`` -> ``gate_proj``, ``up_proj``) and computes each part with the module's own
  ``forward`` (bitsandbytes' ``matmul_4bit`` on the packed NF4 data and its quant state, bias
  included), concatenating the parts' outputs: the very code and tensors of the trainer's
  forward. Per-part matmuls rather than one buffer of the merged weight: the trainer's parameters
  stay as bitsandbytes made them (one quant state per layer, nested quantisation included), and
  nothing is copied or re-laid-out;
- the embedding and the LM head (``VocabParallelEmbedding``): ``SharedEmbeddingMethod`` registers
  the trainer's own tensor as the layer's weight;
- anything else (the norms) vLLM loads from the folder's one small safetensors file.

vLLM's LoRA layers run over any method's ``apply`` and add ``s (x A^T) B^T`` as peft does, so the
policy reaches the engine as a LoRA adapter, synced by ``grpo.rollout.engine.adapter.AdapterSync``.
Exactness: the engine's linear layers hold the trainer's weights and call the same bitsandbytes
op; what differs is vLLM's attention and its LoRA kernels against peft's (tests/test_engine_nf4_form.py
measures the gap), and on CUDA the numerics of that op by row count: bitsandbytes picks its NF4
kernel by the rows of the call (vllm-free bench/nf4_rows.py measures the rows of a decode step
against the same rows of a long forward; bitsandbytes/backends/cuda/ops.py, docs/gpu-notes.md),
so the engine's short decode steps and the trainer's long forwards round differently. The gap
stays small and ``train.guards.max_logp_gap`` bounds it.

Sleep mode (CUDA): vLLM's sleep offloads and restores only what was allocated inside its memory
pool during the engine's start; the shared tensors were allocated by the trainer before it, so
sleep never moves them and frees only the engine's KV cache and buffers
(docs/gpu-notes.md#sleep-and-wake-up). The engine must run in the process that holds the policy:
built elsewhere, ``get_quant_method`` finds no trainer and stops with one line.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.nn import Parameter

from grpo.core.errors import ParamsError
from grpo.core.model_shapes import ModelShapes, count, norm_params
from grpo.rollout.engine.adapter import AdapterSync
from grpo.rollout.engine.forms import WEIGHTS_FORMS, FormNeeds, WeightsForm, lora_buffer_bytes

if TYPE_CHECKING:
    from grpo.core.types import Lengths

METHOD = "grpo_nf4"
"""The quantization method's name, in the engine folder's ``config.json``."""

INPUT_EMBEDDING, OUTPUT_HEAD = "<input embedding>", "<output head>"
"""Keys of the embedding and the head (vLLM builds some models' embedding without a name)."""

_TRAINER: dict[str, torch.nn.Module] | None = None
"""Checkpoint module name -> the trainer's module, while ``sharing`` builds an engine."""


def trainer_modules(policy) -> dict[str, torch.nn.Module]:
    """The modules an ``nf4`` engine shares, by their checkpoint names: every bitsandbytes
    ``Linear4bit`` (under peft's LoRA wrapper: its ``base_layer``); the input embedding and the
    output head under ``INPUT_EMBEDDING`` and ``OUTPUT_HEAD``. Raises ``ValueError`` if the policy has no
    4-bit layers."""
    import bitsandbytes as bnb

    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    shared = {n.removesuffix(".base_layer"): m for n, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    if not shared:
        raise ValueError("train.rollouts.engine_weights nf4: the policy has no 4-bit layers (model.quantization: nf4)")
    shared[INPUT_EMBEDDING], shared[OUTPUT_HEAD] = base.get_input_embeddings(), base.get_output_embeddings()
    return shared


@contextlib.contextmanager
def sharing(policy):
    """Inside the block an engine built in this process shares ``policy``'s weights."""
    global _TRAINER
    _TRAINER = trainer_modules(policy)
    try:
        yield _TRAINER
    finally:
        _TRAINER = None


def _trainer_module(name: str) -> torch.nn.Module:
    if _TRAINER is None:
        raise RuntimeError(f"{METHOD}: the engine must be built inside grpo.rollout.engine.nf4_form.sharing(policy), in the "
                           "training process (VLLM_ENABLE_V1_MULTIPROCESSING=0)")
    if name not in _TRAINER:
        raise KeyError(f"{METHOD}: the policy has no 4-bit module {name!r} for the engine's layer "
                       "(an architecture whose layers vLLM names otherwise; use train.rollouts.engine_weights: dense)")
    return _TRAINER[name]


def _vllm_classes():
    """The method classes, defined on first use so that importing this module needs no vLLM: the
    config class, which hands each layer a ``SharedLinearMethod`` or ``SharedEmbeddingMethod``."""
    return _config_class(_linear_method_class(), _embedding_method_class())


def _linear_method_class():
    from vllm.model_executor.layers.linear import LinearMethodBase
    from vllm.model_executor.utils import set_weight_attrs

    class SharedLinearMethod(LinearMethodBase):
        """A linear layer computed by the trainer's ``Linear4bit`` modules ``parts`` (module docstring)."""

        def __init__(self, prefix: str, parts: tuple[torch.nn.Module, ...]):
            self.prefix, self.parts = prefix, parts

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                           params_dtype, **extra_weight_attrs):
            shapes = [tuple(m.weight.quant_state.shape) for m in self.parts]  # (out, in) each
            wanted = [(out, input_size_per_partition) for out in output_partition_sizes]
            if shapes != wanted:
                raise ValueError(f"{METHOD}: {self.prefix} needs parts of shape {wanted}, the policy's are {shapes} "
                                 "(tensor parallelism is not supported by this form)")
            # holds no data: vLLM's LoRA layers read the base layer's device from its `weight`
            placeholder = Parameter(torch.empty(0, dtype=torch.uint8, device=self.parts[0].weight.device),
                                    requires_grad=False)
            set_weight_attrs(placeholder, extra_weight_attrs)
            layer.register_parameter("weight", placeholder)
            layer.nf4_parts = self.parts  # a tuple: not registered as vLLM's submodules

        def process_weights_after_loading(self, layer) -> None:
            if getattr(layer, "bias", None) is not None:  # the parts add the trainer's own biases
                layer.register_parameter("bias", None)

        def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            out = [m.forward(x) for m in self.parts]  # (tokens, out_i) each
            out = out[0] if len(out) == 1 else torch.cat(out, dim=-1)
            return out if bias is None else out + bias

    return SharedLinearMethod


def _embedding_method_class():
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase
    from vllm.model_executor.utils import set_weight_attrs

    class SharedEmbeddingMethod(QuantizeMethodBase):
        """An embedding or LM head whose weight is the trainer's tensor ``module.weight``."""

        def __init__(self, prefix: str, module: torch.nn.Module):
            self.prefix, self.module = prefix, module

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                           params_dtype, **extra_weight_attrs):
            tensor = self.module.weight.detach()  # (vocab, hidden), the trainer's storage
            wanted = (sum(output_partition_sizes), input_size_per_partition)
            if tuple(tensor.shape) != wanted or tensor.dtype != params_dtype:
                raise ValueError(f"{METHOD}: {self.prefix} needs {wanted} in {params_dtype}, the policy's is "
                                 f"{tuple(tensor.shape)} in {tensor.dtype} (a vocabulary vLLM pads, or another "
                                 "dtype; use train.rollouts.engine_weights: dense)")
            weight = Parameter(tensor, requires_grad=False)
            set_weight_attrs(weight, {"input_dim": 1, "output_dim": 0, **extra_weight_attrs})
            layer.register_parameter("weight", weight)

        def embedding(self, layer, input_: torch.Tensor) -> torch.Tensor:
            return F.embedding(input_, layer.weight)

        def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
            return F.linear(x, layer.weight, bias)

    return SharedEmbeddingMethod


def _config_class(SharedLinearMethod, SharedEmbeddingMethod):  # noqa: N803 (classes)
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.quantization.base_config import QuantizationConfig
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    class SharedNF4Config(QuantizationConfig):
        """vLLM's view of the form: which method each layer gets."""

        def get_name(self) -> str:
            return METHOD

        def get_supported_act_dtypes(self) -> list[torch.dtype]:
            return [torch.float32, torch.float16, torch.bfloat16]

        @classmethod
        def get_min_capability(cls) -> int:
            return 75  # bitsandbytes' CUDA library's oldest architecture (docs/gpu-notes.md)

        @staticmethod
        def get_config_filenames() -> list[str]:
            return []

        @classmethod
        def from_config(cls, config: dict) -> SharedNF4Config:
            return cls()

        def get_quant_method(self, layer, prefix: str):
            if isinstance(layer, LinearBase):
                parent, _, leaf = prefix.rpartition(".")
                parts = self.packed_modules_mapping.get(leaf, [leaf])
                return SharedLinearMethod(prefix, tuple(_trainer_module(f"{parent}.{p}".lstrip(".")) for p in parts))
            if isinstance(layer, VocabParallelEmbedding):
                role = OUTPUT_HEAD if isinstance(layer, ParallelLMHead) else INPUT_EMBEDDING
                return SharedEmbeddingMethod(prefix or role, _trainer_module(role))
            return None

    return SharedNF4Config


def register() -> None:
    """Register the method with vLLM (in this process; idempotent)."""
    from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, register_quantization_config

    if METHOD not in QUANTIZATION_METHODS:
        register_quantization_config(METHOD)(_vllm_classes())


def write_engine_folder(policy, tokenizer, out_dir: str | Path, dtype: torch.dtype) -> list[str]:
    """The folder an ``nf4`` engine starts from: the policy's config naming ``METHOD`` as its
    quantization, its generation config and tokenizer, and one safetensors file of the tensors the
    engine does not share (the norms), in ``dtype``. Weights files already there (a dense
    engine's export, which vLLM would read instead) are removed first. Returns the tensors' names."""
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in [*out_dir.glob("*.safetensors"), *out_dir.glob("*.safetensors.index.json")]:
        stale.unlink()
    base = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    shared = trainer_modules(policy)
    owned = {id(p) for m in shared.values() for p in m.parameters()}
    tensors = {name.replace(".base_layer.", "."): p.detach().to(dtype).cpu().contiguous()
               for name, p in base.named_parameters() if id(p) not in owned and "lora_" not in name}
    save_file(tensors, out_dir / "model.safetensors", metadata={"format": "pt"})
    config = base.config.to_dict()
    config.update(quantization_config={"quant_method": METHOD}, dtype=str(dtype).removeprefix("torch."))
    config.pop("torch_dtype", None)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if getattr(base, "generation_config", None) is not None:
        base.generation_config.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    return sorted(tensors)


@WEIGHTS_FORMS.register("nf4")
class NF4Form(WeightsForm):
    """The engine computes with the trainer's 4-bit layers, embedding and head, and takes the policy
    as a LoRA adapter at each sync (module docstring)."""

    auto_priority = 20  # auto: where dense does not fit

    forces_eager = True  # bitsandbytes' calls are not captured in CUDA graphs
    sync = None  # an ``AdapterSync``, made by ``start``

    def write_folder(self, policy, tokenizer, base) -> None:
        """The policy's config naming ``METHOD``, its tokenizer and norms (``write_engine_folder``)."""
        write_engine_folder(policy, tokenizer, self.engine_dir, self.dtype)

    @classmethod
    def engine_lora(cls, policy_rank: int) -> int | None:
        return policy_rank

    def start(self, args: dict, tokenizer, policy, limits: Lengths):
        """The engine built inside ``sharing(policy)``, the method registered with vLLM first."""
        register()
        with sharing(policy):
            sampler = super().start(args, tokenizer, policy, limits)
        self.sync = AdapterSync(policy, self.engine_dir)
        return sampler

    @classmethod
    def unusable(cls, params) -> str | None:
        if params.model.quantization != "nf4":
            return f"model.quantization {params.model.quantization}: no 4-bit base to share"
        return None

    @classmethod
    def check_params(cls, params) -> None:
        if cls.unusable(params) is not None:
            raise ParamsError("train.rollouts.engine_weights: nf4 shares the trainer's 4-bit base, and model.quantization is "
                              f"{params.model.quantization}; set model.quantization: nf4, or engine_weights dense or auto")

    @classmethod
    def needs(cls, shapes: ModelShapes, lora_rank: int, b: int, dtype: str) -> FormNeeds:
        """The norms in ``b`` bytes (the 4-bit layers, embedding and head are the trainer's), vLLM's
        LoRA buffers at ``lora_rank``, and the largest 4-bit layer dequantised by bitsandbytes for
        a long forward of the profile run."""
        return FormNeeds(
            weights=norm_params(shapes) * b,
            weights_how=(f"the norms, {count(norm_params(shapes))} params in {dtype}; the 4-bit layers, embedding and "
                         "head are the trainer's (grpo.rollout.engine.nf4_form)"),
            lora=lora_buffer_bytes(shapes, cls.engine_lora(lora_rank), b),
            dequant=max(x.params for x in shapes.linears if x.quantized) * b,
            dequant_how="the largest 4-bit layer dequantised")
