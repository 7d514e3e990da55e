"""grpo.rollout.engine.adapter: the nf4 engine's sync (the engine side is tested in tests/test_engine_nf4_form.py)."""

from __future__ import annotations

from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.model.lora_policy import load_policy
from grpo.rollout.engine.adapter import AdapterSync, policy_lora_rank


def test_the_policy_lora_rank_is_its_largest(tiny_model_dir):
    for rank in (1, 4, 17):
        model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(rank=rank, alpha=2 * rank))
        assert policy_lora_rank(model) == rank


def test_the_sync_counts_the_adapted_layers(tiny_model_dir, tmp_path):
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(rank=2, target_modules=["q_proj", "v_proj"]))
    sync = AdapterSync(model, tmp_path)
    assert sync.adapted_layers == 2 * 2 and sync.syncs == 0
    assert sync.adapter_dir.parent == tmp_path
