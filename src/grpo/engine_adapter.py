"""Training rollouts from a vLLM engine that holds the base once and takes the policy as a LoRA adapter.

The ``adapter`` engine form (``train.engine_weights``); ``grpo.engine_policy`` is the ``dense``
form, and this class shares its start, sleep and wake-up. The engine starts from the same dense
export of the base (``grpo.policy.export_dense``: the NF4 base dequantised), or, with
``base_form="int4"`` (``make_backend``'s default on CUDA), from that export rewritten as a 4-bit
GPTQ checkpoint (``grpo.gptq``: a quarter of the weights' bytes, an engine base that differs from
the trainer's NF4 one), with vLLM's LoRA support on: ``enable_lora``, one adapter slot (``max_loras=1``) and ``max_lora_rank`` the
smallest rank vLLM accepts that holds the policy's (``engine_lora_rank``). Each ``sync(model)``:

1. writes the policy's adapter in PEFT format (``adapter_config.json``, ``adapter_model.safetensors``)
   into the backend's one adapter directory, over the last sync's;
2. removes the last sync's adapter from the engine and adds this one under a new id
   (``LoRARequest("policy-<n>", n, dir)``, ``n`` counting syncs from 1), which loads it now;
3. every later generation call carries that request (``VLLMBackend.lora_request``).

Why a new id per sync (vLLM 0.32.0, paths under vllm/): the worker loads an adapter only when its
id is not loaded yet, or on every call that carries ``load_inplace=True`` (lora/worker_manager.py:
289-325), which would reread the files at every scheduler step; a new id reads them once. With one
CPU slot (``max_cpu_loras`` defaults to ``max_loras``: config/lora.py:120-121) an evicted adapter
would be read again from its directory (worker_manager.py:304-316), which still holds the current
one. The prefix cache needs no reset: a KV block's hash includes the request's LoRA name and path
(v1/core/kv_cache_utils.py:578-595), and each sync has a new name. On CUDA the LoRA buffers are
created while the model loads (v1/worker/gpu_model_runner.py:5066-5067), inside the ``weights``
memory pool (v1/worker/gpu_worker.py:587-589), so ``sleep(level=1)`` offloads and restores them
with the base.

Exactness: vLLM's LoRA layers compute ``x W^T + s (x A^T) B^T``, as peft does, on the dequantised
base; greedy outputs equal the policy's own after every sync (tests/test_engine_adapter.py), and
the per-token log-prob gap is logged every step as for the dense form.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import torch

from grpo.engine_policy import VLLMPolicyBackend


def vllm_lora_ranks() -> tuple[int, ...]:
    """The ``max_lora_rank`` values vLLM accepts (``MaxLoRARanks``, vllm/config/lora.py:26)."""
    from typing import get_args

    from vllm.config.lora import MaxLoRARanks

    return tuple(sorted(get_args(MaxLoRARanks)))


def engine_lora_rank(model) -> int:
    """The smallest rank vLLM accepts that holds every LoRA layer of ``model`` (a peft model); read
    from vLLM here, as ``grpo.memory.engine_lora_rank`` counts it from its copy of the ranks."""
    cfg = model.peft_config[model.active_adapter]
    rank = max([cfg.r, *cfg.rank_pattern.values()])
    ranks = vllm_lora_ranks()
    for allowed in ranks:
        if allowed >= rank:
            return allowed
    raise ValueError(f"lora.rank: {rank} is above vLLM's largest LoRA rank {ranks[-1]} (train.engine_weights: dense)")


class VLLMAdapterBackend(VLLMPolicyBackend):
    """A ``RolloutBackend`` whose engine holds the base and samples with the policy's adapter as of
    the last ``sync`` (before the first sync: the base alone). ``synced_layers``: how many adapted
    layers the last sync sent."""

    weights_form = "adapter"

    def __init__(self, model, tokenizer, engine_dir, *, base_form: str = "dense", **settings):
        self.base_form = base_form  # what ``engine_dir`` holds: dense weights or a 4-bit GPTQ checkpoint (grpo.gptq)
        super().__init__(model, tokenizer, engine_dir, **settings)

    def engine_options(self, model) -> dict:
        """vLLM's LoRA support, one adapter of the policy's rank."""
        return {"enable_lora": True, "max_loras": 1, "max_lora_rank": engine_lora_rank(model)}

    def prepare(self, model, dtype: torch.dtype) -> None:
        """The adapter's directory, beside the engine's base; no base weights are kept here."""
        from peft.tuners.lora.layer import LoraLayer

        # one folder per rank: data-parallel ranks on a machine share the engine's base folder
        self.adapter_dir = Path(self.model_path) / f"policy_adapter.rank{os.environ.get('RANK', '0')}"
        self.adapted_layers = sum(isinstance(m, LoraLayer) for m in model.get_base_model().modules())
        if not self.adapted_layers:
            raise ValueError("the policy has no LoRA layers to sync")
        self.syncs = 0

    def sync(self, model) -> None:
        """Write the policy's adapter and load it into the engine under a new id (module docstring)."""
        from vllm.lora.request import LoRARequest

        self.wake_up()
        model.save_pretrained(self.adapter_dir, save_embedding_layers=False)
        engine = self._engine().llm_engine
        if self.lora_request is not None:
            engine.remove_lora(self.lora_request.lora_int_id)
            self.lora_request = None
        self.syncs += 1
        request = LoRARequest(f"policy-{self.syncs}", self.syncs, str(self.adapter_dir))
        engine.add_lora(request)
        self.lora_request = request
        self.synced_layers = self.adapted_layers

    def close(self) -> None:
        """As ``VLLMPolicyBackend.close``, and remove the adapter's directory."""
        super().close()
        self.lora_request = None
        if getattr(self, "adapter_dir", None) is not None:
            shutil.rmtree(self.adapter_dir, ignore_errors=True)
