"""grpo.rollout.engine.bounds: a step's generation calls, the train engine's bounds for them, a saved
model's sampler bounded to its stage's call, and a CPU engine's KV cache against the bytes a real
transformers KV cache of those sequences holds."""

from __future__ import annotations

import pytest

from grpo.config.sections.engine import VLLMEngineConfig
from grpo.config.sections.evaluate_section import EvaluateConfig
from grpo.config.sections.sent import SentConfig
from grpo.config.sections.train import TrainConfig
from grpo.rollout.engine.bounds import (
    CPU_BLOCK_SIZE,
    SAVED_MODEL_SEQS,
    Bounds,
    cpu_kv_bytes,
    generation_calls,
    saved_model_bounds,
    saved_model_kv_bytes,
    saved_model_seqs,
    step_limits,
    train_bounds,
)


@pytest.mark.parametrize(("n", "g", "size", "expected"), [
    (3, 4, 0, [(0, 3, 4)]),                                      # one call for the step
    (3, 4, 12, [(0, 3, 4)]),                                     # the step fits
    (5, 2, 4, [(0, 2, 2), (2, 4, 2), (4, 5, 2)]),                # two whole groups per call, one left
    (3, 4, 6, [(0, 1, 4), (1, 2, 4), (2, 3, 4)]),                # one group per call (6 // 4)
    (2, 4, 3, [(0, 1, 3), (0, 1, 1), (1, 2, 3), (1, 2, 1)]),     # a group split 3 + 1
    (1, 5, 2, [(0, 1, 2), (0, 1, 2), (0, 1, 1)]),
])
def test_generation_calls_cover_every_completion_once(n, g, size, expected):
    calls = generation_calls(n, g, size)
    assert calls == expected
    per_prompt = [sum(k for lo, hi, k in calls if lo <= i < hi) for i in range(n)]
    assert per_prompt == [g] * n and all((hi - lo) * k <= (size or n * g) for lo, hi, k in calls)


@pytest.mark.parametrize("fields,processes,expected", [
    ({}, 1, (16, 2048)),                                                    # 4 prompts x G = 4
    ({"prompts_per_step": 2, "group_size": 8}, 1, (16, 2048)),             # seed 003
    ({"generation_batch_size": 6}, 1, (4, 2048)),                          # whole groups of 4 per call
    ({"generation_batch_size": 3}, 1, (3, 2048)),                          # a group over calls of 3 + 1
    ({"prompts_per_step": 8}, 2, (16, 2048)),                              # 4 prompts a process
    ({"max_num_batched_tokens": 8}, 1, (16, 16)),                          # a token per sequence at least
    ({"max_model_len": 64}, 1, (16, 1024)),                                # at most max_num_seqs x max_model_len
])
def test_the_engine_is_bounded_to_one_generation_call(fields, processes, expected):
    assert step_limits(TrainConfig(rollouts={"group_size": 4, **fields}), processes) == expected  # G = 4 unless given



def test_a_cpu_engine_holds_one_calls_kv_cache_in_whole_blocks():
    """``cpu_kv_bytes``: keys and values of every layer for the call's sequences at ``max_model_len``
    rounded up to whole ``CPU_BLOCK_SIZE`` blocks; grouped KV heads counted as the model has them
    (the same formula as ``grpo.tools.memory.kv_cache_bytes``, which tests/test_memory.py checks against
    a real KV cache)."""
    from transformers import LlamaConfig

    from grpo.tools import memory

    config = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=100)
    seqs, length = 3, 40
    positions = -(-length // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE  # 64
    assert positions == 64
    assert cpu_kv_bytes(config, seqs, length, 4) == 2 * 2 * 2 * 16 * positions * seqs * 4  # L x (K, V) x k x d
    assert cpu_kv_bytes(config, seqs, length, 4) == memory.kv_cache_bytes(memory.model_shapes(config), seqs, positions, 4)


def test_train_bounds_size_the_engine_to_the_step_and_only_on_a_cpu_its_kv_cache():
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4)
    cfg = TrainConfig(rollouts={"prompts_per_step": 4, "group_size": 8, "max_model_len": 100})
    cpu, cuda = train_bounds(cfg, config, "cpu", 2), train_bounds(cfg, config, "cuda", 2)
    assert (cpu.max_num_seqs, cpu.max_num_batched_tokens) == step_limits(cfg) == (32, 2048)
    assert cpu.kv_cache_memory_bytes == cpu_kv_bytes(config, 32, 100, 2) and cuda.kv_cache_memory_bytes is None
    assert cuda.llm_kwargs() == {"max_num_seqs": 32, "max_num_batched_tokens": 2048}
    assert Bounds(256).llm_kwargs() == {"max_num_seqs": 256}


@pytest.mark.parametrize(("prompts", "samples", "expected"), [
    (64, 8, 256),    # the embedded default's SENT: 512 sequences, vLLM's 256 in flight as before
    (64, 1, 64),     # the embedded default's evaluation: a call never has more than 64 in flight
    (32, 8, 256),    # exactly vLLM's default
    (3, 8, 24),
    (1, 1, 1),
    (1000, 1, 256),  # never above vLLM's default
])
def test_a_saved_model_sampler_is_bounded_to_its_call_and_never_above_vllms_default(prompts, samples, expected):
    assert SAVED_MODEL_SEQS == 256
    assert saved_model_seqs(prompts, samples) == expected


def test_saved_model_bounds_read_the_stages_call_and_leave_the_tokens_to_vllm():
    """SENT: ``batch_prompts x num_samples``; evaluation: ``batch_prompts x 1``; a bare engine
    section (no call size): vLLM's default. ``max_num_batched_tokens`` is never set (vLLM's default)."""
    assert saved_model_bounds(SentConfig()) == Bounds(256)  # 64 x 8
    assert saved_model_bounds(SentConfig(batch_prompts=4, num_samples=8)) == Bounds(32)
    assert saved_model_bounds(EvaluateConfig()) == Bounds(64)
    assert saved_model_bounds(EvaluateConfig(batch_prompts=5)).llm_kwargs() == {"max_num_seqs": 5}
    assert saved_model_bounds(VLLMEngineConfig()) == Bounds(SAVED_MODEL_SEQS)


def test_a_saved_models_cpu_kv_cache_holds_every_sequence_of_a_call_at_full_length():
    """``saved_model_kv_bytes``: the call's sequences at ``positions`` rounded up to whole blocks,
    one block more each (the pool's reserved block), never below one ``max_model_len`` sequence;
    ``saved_model_bounds`` passes it on only when given the model (a CPU engine)."""
    from types import SimpleNamespace

    config = SimpleNamespace(num_attention_heads=4, hidden_size=64, num_key_value_heads=2, num_hidden_layers=3)
    per_token = 3 * 2 * 2 * 16 * 2  # L x (K, V) x k x d x b, bf16
    assert saved_model_kv_bytes(config, 8, 70, 256, 2) == 8 * (96 + 32) * per_token  # 70 -> 3 blocks, + 1
    assert saved_model_kv_bytes(config, 8, 64, 256, 2) == 8 * (64 + 32) * per_token  # whole blocks stay
    assert saved_model_kv_bytes(config, 1, 40, 1024, 2) == (1024 + 32) * per_token  # vLLM's floor: one max_model_len
    section = SentConfig(batch_prompts=4, num_samples=8, max_model_len=1024)
    assert saved_model_bounds(section).kv_cache_memory_bytes is None  # the RAM share
    sized = saved_model_bounds(section, (config, 150, 2))
    assert sized == Bounds(32, None, saved_model_kv_bytes(config, 32, 150, 1024, 2))
    assert sized.llm_kwargs()["kv_cache_memory_bytes"] == 32 * (160 + 32) * per_token
