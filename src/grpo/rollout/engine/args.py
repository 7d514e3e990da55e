"""The one builder of a vLLM engine's ``LLM(...)`` arguments, and the environment it starts in.

``engine_args`` turns the calling stage's engine section (``sent``, ``evaluate`` or ``train``:
``gpu_memory_utilization``, ``max_model_len``), the device, the engine's bounds
(``grpo.rollout.engine.bounds``) and its role into keywords:

- every engine: the model directory (also its tokenizer), seed, dtype, memory share, length,
  ``enforce_eager``, the bounds;
- on a CPU: the ``uni`` executor (the engine in this process) and ``CPU_BLOCK_SIZE`` KV blocks;
- the policy's engine in training (an ``EngineRole``: its processes and LoRA rank): the ``uni``
  executor, or vLLM's ``external_launcher`` when several training processes each hold an engine;
  on CUDA sleep mode; with ``lora_rank`` vLLM's LoRA support with one adapter slot of the smallest rank vLLM accepts.

``start_environment`` sets the variables an engine reads at start (a user's own values win).
Why each setting, with the vLLM lines it follows: docs/gpu-notes.md#vllm-source-map.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from grpo.rollout.engine.bounds import CPU_BLOCK_SIZE, Bounds

LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
"""vLLM's allowed ``max_lora_rank`` values (``MaxLoRARanks``), held here so that ``grpo check``
runs without vLLM; tests/test_engine_args.py holds it equal to vLLM's."""


def engine_lora_rank(rank: int) -> int:
    """vLLM's ``max_lora_rank`` for an adapter of ``rank``: the smallest allowed value >= ``rank``."""
    for allowed in LORA_RANKS:
        if allowed >= rank:
            return allowed
    raise ValueError(f"lora.rank: {rank} is above vLLM's largest LoRA rank {LORA_RANKS[-1]} "
                     "(train.rollouts.engine_weights: dense)")


def request_amx() -> bool:
    """Ask the kernel for this process's AMX tile state (``torch.cpu._init_amx``, a no-op False on
    a CPU without AMX). vLLM's CPU attention runs AMX tiles for bf16 and dies of SIGILL in a process
    that has not asked: oneDNN asks on its first AMX matmul, so an engine started before any bf16
    matmul of its process (a test alone, a fresh worker) crashed where one started later did not."""
    import torch

    return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


def start_environment(device: str, in_process: bool) -> None:
    """Before an engine starts: FlashInfer's top-k/top-p sampler off (on CUDA vLLM turns it on by
    default and FlashInfer compiles it with nvcc at the engine's first sampling, which torch's
    wheels do not ship: docs/gpu-notes.md#flashinfer-sampler); on a CPU the AMX tile state
    requested (``request_amx``) and compute on every core this
    process may run on (vLLM's CPU default binds one core and reserves the rest) and keep the engine
    in this process; with ``in_process`` (the policy's engine) keep it in this process on any
    device. A variable the user set wins. The variables stay set, and an engine core started in
    this process freezes vLLM's environment cache (vllm/v1/engine/core.py, ``enable_envs_cache``):
    after the first in-process engine, every later engine of the process runs in it too."""
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    if device == "cpu":
        request_amx()
        cpus = sorted(os.sched_getaffinity(0))
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
        os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    if device == "cpu" or in_process:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")


@dataclass(frozen=True)
class EngineRole:
    """The policy's engine in training (``engine_args``' ``role``; ``None``: a saved model's
    sampler): the training ``processes`` (several: vLLM's ``external_launcher``, each process
    holding an engine) and ``lora_rank``, the policy's LoRA rank where the form serves an adapter
    (``None``: no LoRA support)."""

    processes: int
    lora_rank: int | None = None


def engine_args(model_dir: str, section, *, device: str, seed: int, dtype: str, bounds: Bounds,
                enforce_eager: bool = True, role: EngineRole | None = None) -> dict:
    """``LLM`` keywords of one engine (module docstring). ``section``: the stage's engine params
    (``gpu_memory_utilization``, ``max_model_len``); ``dtype``: vLLM's name (``bfloat16``, ...);
    ``role``: ``None`` for a saved model's sampler, else the policy's engine (``EngineRole``)."""
    args = {"model": str(model_dir), "tokenizer": str(model_dir), "seed": seed, "dtype": dtype,
            "gpu_memory_utilization": section.gpu_memory_utilization, "max_model_len": section.max_model_len,
            "enforce_eager": enforce_eager, "use_tqdm_on_load": False,  # the stage's own bar is the one shown
            **bounds.llm_kwargs()}
    if device == "cpu":
        args.update(distributed_executor_backend="uni", block_size=CPU_BLOCK_SIZE)
    if role is not None:
        args["distributed_executor_backend"] = "external_launcher" if role.processes > 1 else "uni"
        if device == "cuda":
            args["enable_sleep_mode"] = True
        if role.lora_rank is not None:
            args.update(enable_lora=True, max_loras=1, max_lora_rank=engine_lora_rank(role.lora_rank))
    return args
