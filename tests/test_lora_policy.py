"""The policy of ``grpo.model.lora_policy``: 4-bit base + LoRA, the reference as the adapter switched off, and a
clear error for a LoRA target the model does not have."""

from __future__ import annotations

import pytest
import torch

from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.core.errors import ModelConfigError
from grpo.model.lora_policy import load_policy

from .helpers import LORA, give_adapter_a_say


def test_policy_is_4bit_lora_and_reference_is_adapter_off(tiny_model_dir):
    import bitsandbytes as bnb

    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    base = model.get_base_model()
    assert isinstance(base.model.layers[0].mlp.up_proj, bnb.nn.Linear4bit)
    assert base.model.layers[0].mlp.up_proj.weight.quant_state.quant_type == "nf4"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    # a non-zero adapter changes the output; disable_adapter gives the base model back
    give_adapter_a_say(model, std=0.5)
    ids = torch.randint(3, 90, (1, 12))
    with torch.no_grad():
        with_adapter = model(input_ids=ids).logits
        with model.disable_adapter():
            reference = model(input_ids=ids).logits
        again = model(input_ids=ids).logits
    assert not torch.allclose(with_adapter, reference)
    torch.testing.assert_close(with_adapter, again)


def test_unknown_lora_target_is_a_clear_error(tiny_model_dir):
    with pytest.raises(ModelConfigError, match="lora.target_modules: .*c_attn"):
        load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(target_modules=["q_proj", "c_attn"]))


def test_export_dense_frees_the_cache_once_the_4bit_copy_is_gone(tiny_model_dir, tmp_path, monkeypatch):
    """``export_dense`` hands the device's cached memory back (``grpo.core.device.free_cuda_cache``) on
    the device it loaded the 4-bit base on, at a point where none of its 4-bit layers is still
    referenced (else the cache keeps them: the evaluation engine then finds the GPU memory taken)."""
    import gc

    import bitsandbytes as bnb

    import grpo.model.lora_policy
    from grpo.core.device import default_device

    def live_4bit() -> int:
        gc.collect()
        return sum(isinstance(o, bnb.nn.Linear4bit) for o in gc.get_objects())

    before, calls = live_4bit(), []
    monkeypatch.setattr(grpo.model.lora_policy, "free_cuda_cache", lambda device: calls.append((device, live_4bit())))
    out = grpo.model.lora_policy.export_dense(ModelConfig(path=str(tiny_model_dir)), None, tmp_path / "dense")
    assert calls == [(default_device(), before)]
    assert out["weights"] == "dense weights (NF4 dequantised)" and (tmp_path / "dense" / "config.json").exists()


def _export_as_before(model_cfg: ModelConfig, adapter_dir) -> dict[str, torch.Tensor]:
    """The export as it was written before it streamed: the whole base loaded in fp32, every 4-bit
    layer replaced by a dense fp32 ``nn.Linear``, the adapter merged by peft's ``merge_and_unload``,
    the state dict as ``save_pretrained`` writes it (the tied head once)."""
    import bitsandbytes as bnb
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from grpo.model.nf4_layers import dense_weight, nf4_config

    model = AutoModelForCausalLM.from_pretrained(model_cfg.path, dtype=torch.float32,
                                                 quantization_config=nf4_config(torch.float32), device_map={"": "cpu"})
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, bnb.nn.Linear4bit):
                dense = torch.nn.Linear(child.in_features, child.out_features, bias=child.bias is not None)
                dense.weight.data = dense_weight(child).float()
                setattr(parent, name, dense)
    model.hf_quantizer, model.is_loaded_in_4bit = None, False
    if adapter_dir is not None:
        model = PeftModel.from_pretrained(model, str(adapter_dir)).merge_and_unload()
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _read_export(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for file in sorted(path.glob("*.safetensors")):
        out.update(load_file(file))
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_export_dense_writes_shard_by_shard_the_weights_it_wrote_whole_before(dtype, tiny_model_dir, tmp_path):
    """The streamed export holds, tensor for tensor, what the whole-model fp32 export held, cast once
    to the engine's dtype (bf16 here as on CUDA), the adapter merged; small shards give Hugging
    Face's sharded layout (index json naming every tensor's file), which transformers loads back."""
    import json

    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import grpo.model.lora_policy

    base = tiny_model_dir
    if dtype != torch.float32:  # a checkpoint in the engine's dtype, as the hub's are (bf16): both load the same values
        base = tmp_path / "base"
        AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=dtype).save_pretrained(base)
        AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(base)
    model_cfg = ModelConfig(path=str(base))
    policy = get_peft_model(AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32),
                            PeftLoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
    give_adapter_a_say(policy, std=0.5)
    policy.save_pretrained(tmp_path / "adapter")
    expected = _export_as_before(model_cfg, tmp_path / "adapter")
    out = tmp_path / "dense"
    out.mkdir()
    (out / "model-00001-of-00009.safetensors").write_bytes(b"an older export's shard")
    result = grpo.model.lora_policy.export_dense(model_cfg, tmp_path / "adapter", out, dtype=dtype, max_shard_bytes=40_000)
    assert result["weights"] == "dense weights (NF4 dequantised) + LoRA merged"
    assert result["dtype"] == str(dtype).removeprefix("torch.")
    files = result["files"]
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert sorted(p.name for p in out.glob("*.safetensors")) == sorted(files)  # the stale shard is gone
    index = json.loads((out / "model.safetensors.index.json").read_text())
    written = _read_export(out)
    assert set(index["weight_map"]) == set(written) == set(expected)
    assert set(index["weight_map"].values()) == set(files)
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in written.values())
    for name, tensor in expected.items():
        assert written[name].dtype == dtype and torch.equal(written[name], tensor.to(dtype)), name
    config = json.loads((out / "config.json").read_text())
    assert config["dtype"] == str(dtype).removeprefix("torch.") and "quantization_config" not in config
    loaded = AutoModelForCausalLM.from_pretrained(out, dtype=dtype)
    assert torch.equal(loaded.model.layers[0].self_attn.q_proj.weight, written["model.layers.0.self_attn.q_proj.weight"])


def test_export_dense_defaults_to_the_compute_dtype_in_one_file(tiny_model_dir, tmp_path):
    """Without ``dtype``: ``grpo.core.device.compute_dtype(model.dtype)``; a model under one shard is one
    ``model.safetensors`` without an index, as ``save_pretrained`` writes it. The 4-bit weights are
    training's own: the base is quantised from the checkpoint loaded in that dtype, as
    ``load_training_base`` does (the tiny checkpoint is fp32, so its bf16 base is not the fp32 one's)."""
    import bitsandbytes as bnb

    import grpo.model.lora_policy
    from grpo.core.device import compute_dtype, default_device
    from grpo.model.lora_policy import load_training_base
    from grpo.model.nf4_layers import dense_weight

    out = grpo.model.lora_policy.export_dense(ModelConfig(path=str(tiny_model_dir)), None, tmp_path / "dense")
    assert out["dtype"] == str(compute_dtype("auto", default_device())).removeprefix("torch.")
    assert out["files"] == ["model.safetensors"] and not (tmp_path / "dense" / "model.safetensors.index.json").exists()
    out = grpo.model.lora_policy.export_dense(ModelConfig(path=str(tiny_model_dir), dtype="bfloat16"), None, tmp_path / "bf16")
    assert out["dtype"] == "bfloat16"
    written = _read_export(tmp_path / "bf16")
    assert {t.dtype for t in written.values()} == {torch.bfloat16}
    trained = load_training_base(ModelConfig(path=str(tiny_model_dir), dtype="bfloat16"))
    layers = {f"{n}.weight": m for n, m in trained.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    assert layers
    for name, layer in layers.items():
        assert torch.equal(written[name], dense_weight(layer, torch.float32).to(torch.bfloat16)), name
