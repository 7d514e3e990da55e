"""The memory estimate's exact parts (``grpo.memory``), checked against real objects on the tiny Llama and
on a random model of SmolLM2-135M's width (2 of its 30 layers: the per-layer shapes are the real ones):
LoRA parameters against peft's trainable count, NF4 weight bytes against bitsandbytes' storage,
the KV cache against a ``DynamicCache``, saved activations against autograd's saved tensors
(``bench/memory_estimate.py`` runs the same checks on the full 30-layer shape).
"""

from __future__ import annotations

import sys

import pytest
import torch
import yaml

from grpo import memory

from .conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from memory_estimate import (  # noqa: E402
    batch,
    real_kv_bytes,
    real_lora_params,
    real_weight_bytes,
    saved_activation_bytes,
)

sys.path.remove(str(REPO / "bench"))


@pytest.fixture(scope="module")
def smol_width_dir(tmp_path_factory):
    """A random model of SmolLM2-135M's exact width (hidden 576, 9/3 heads, intermediate 1536,
    vocab 49,152, tied), 2 layers."""
    from grpo.synthetic import architecture_config, random_model_dir

    cfg = architecture_config("smollm2-135m")
    cfg.num_hidden_layers = 2
    return random_model_dir(tmp_path_factory.mktemp("smol-width"), cfg)


@pytest.mark.parametrize("which", ["tiny", "smol"])
def test_lora_nf4_and_kv_cache_terms_equal_the_real_objects(which, tiny_model_dir, smol_width_dir):
    from transformers import AutoConfig

    from grpo.config import LoraConfig, ModelConfig
    from grpo.policy import attach_lora, load_training_base

    path = tiny_model_dir if which == "tiny" else smol_width_dir
    shapes = memory.model_shapes(AutoConfig.from_pretrained(path))
    base = load_training_base(ModelConfig(path=str(path)), "cpu")
    # NF4 weights + the rest in fp32: to the byte (the brief allows 10%)
    assert memory.weight_bytes(shapes, "nf4", 4) == real_weight_bytes(base)
    # KV cache of a short fixed-length generation: 4 rows, 12 prompt tokens (3 padded) + 5 generated - 1
    ids, mask = batch(shapes.vocab, 2, 2, 12, 0)
    assert memory.kv_cache_bytes(shapes, 4, 12 + 5 - 1, 4) == real_kv_bytes(base, ids, mask, 5)
    lora = LoraConfig(target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    model = attach_lora(base, lora, gradient_checkpointing=False)
    assert memory.lora_params(shapes, lora.rank, lora.target_modules) == real_lora_params(model)


@pytest.mark.parametrize("dtype,dropout,checkpointing,shared", [
    ("float32", 0.0, False, True), ("float32", 0.0, False, False), ("float32", 0.0, True, False),
    ("bfloat16", 0.05, False, True),
])
def test_activation_term_matches_autograds_saved_tensors(dtype, dropout, checkpointing, shared, tiny_model_dir):
    from transformers import AutoConfig

    from grpo.config import LoraConfig, ModelConfig
    from grpo.policy import load_policy

    torch.manual_seed(0)
    shapes = memory.model_shapes(AutoConfig.from_pretrained(tiny_model_dir))
    lora = LoraConfig(dropout=dropout)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype=dtype, gradient_checkpointing=checkpointing),
                        lora, "cpu")
    prompts, group, p, c = 2, 4, 16, 24
    ids, mask = batch(shapes.vocab, prompts, group, p, c)
    est, _ = memory.activation_bytes(
        shapes, rows=prompts * group, prompt=p, completion=c, group=group, b=torch.finfo(getattr(torch, dtype)).bits // 8,
        lora_rank=lora.rank, targets=lora.target_modules, dropout=dropout, checkpointing=checkpointing,
        shared=shared and not checkpointing, device="cpu")
    real = saved_activation_bytes(model, ids, mask, p, group if shared else 1)
    assert est == pytest.approx(real, rel=0.03)


def test_shapes_from_a_hub_name_and_the_lora_count_of_seed003():
    from grpo.config import ModelConfig

    shapes = memory.resolve_shapes(ModelConfig(name="deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B",
                                               path="models/none"), REPO)
    assert shapes.hidden == 1536 and shapes.layers == 28 and shapes.vocab == 151936
    assert memory.lora_params(shapes, 16, ["q_proj", "k_proj", "v_proj", "o_proj"]) == 4_358_144  # README: ~4.4 M


def test_measured_figures_name_real_params_and_a_bad_file_is_one_line(tmp_path):
    """measured.yaml (the one home of the figures ``grpo check`` prints) names params fields that
    exist; an entry missing a key fails with one line naming the file."""
    from grpo.config import Params

    entries = memory.load_measured()
    assert {m["device"] for m in entries} == {"cpu", "cuda"}
    for m in entries:
        for key in m["params"]:
            section, name = key.split(".")
            assert name in type(getattr(Params(), section)).model_fields, key
    bad = tmp_path / "measured.yaml"
    bad.write_text(yaml.safe_dump([{"what": "x", "device": "cpu"}]))
    with pytest.raises(ValueError, match=r"measured.yaml: entry 0: missing command, date, commit, shape, params, figure"):
        memory.load_measured(bad)
