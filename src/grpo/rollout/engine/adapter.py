"""The ``nf4`` engine's sync: the policy reaches the engine as a LoRA adapter.

The ``nf4`` engine (``grpo.rollout.engine.nf4_form``) starts with vLLM's LoRA support: one adapter slot of the
smallest rank vLLM accepts that holds the policy's (``grpo.rollout.engine.args.engine_lora_rank``). Each
``AdapterSync.push``:

1. writes the policy's adapter in PEFT format into the strategy's one adapter directory, over the
   last sync's;
2. removes the last sync's adapter from the engine and adds this one under a new id
   (``LoRARequest("policy-<n>", n, dir)``, ``n`` counting syncs from 1), which loads it now;
3. every later generation call carries that request (``VLLMSampler.lora_request``).

A new id per sync makes the worker read the files once (an id already loaded is not re-read, and
``load_inplace`` would re-read them at every scheduler step), and the prefix cache needs no reset:
a KV block's hash includes the request's LoRA name. The vLLM lines: docs/gpu-notes.md#lora-loading.
vLLM's LoRA layers compute ``x W^T + s (x A^T) B^T`` as peft does; greedy outputs equal the
policy's own after every sync (tests/test_engine_nf4_form.py).
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path


def policy_lora_rank(model) -> int:
    """The largest LoRA rank of the peft ``model``'s active adapter (rank pattern included)."""
    cfg = model.peft_config[model.active_adapter]
    return max([cfg.r, *cfg.rank_pattern.values()])


class AdapterSync:
    """The sync of a form whose engine takes the policy's adapter as a LoRA adapter (``nf4``'s;
    ``grpo.rollout.engine.policy_engine.PolicyEngine``); ``engine_dir``: the engine's folder, beside which the
    adapter is written."""

    def __init__(self, model, engine_dir: str | Path):
        from peft.tuners.lora.layer import LoraLayer

        # one folder per rank: data-parallel ranks on a machine share the engine's base folder
        self.adapter_dir = Path(engine_dir) / f"policy_adapter.rank{os.environ.get('RANK', '0')}"
        self.adapted_layers = sum(isinstance(m, LoraLayer) for m in model.get_base_model().modules())
        if not self.adapted_layers:
            raise ValueError("the policy has no LoRA layers to sync")
        self.syncs = 0

    def push(self, sampler, model) -> int:
        """Write the policy's adapter and load it into ``sampler``'s engine under a new id; the
        adapted layers sent."""
        from vllm.lora.request import LoRARequest

        model.save_pretrained(self.adapter_dir, save_embedding_layers=False)
        engine = sampler.engine().llm_engine
        if sampler.lora_request is not None:
            engine.remove_lora(sampler.lora_request.lora_int_id)
            sampler.lora_request = None
        self.syncs += 1
        request = LoRARequest(f"policy-{self.syncs}", self.syncs, str(self.adapter_dir))
        if not engine.add_lora(request) or request.lora_int_id not in engine.list_loras():
            raise RuntimeError(f"engine: the adapter of sync {self.syncs} did not load ({self.adapter_dir})")
        sampler.lora_request = request
        return self.adapted_layers

    def close(self) -> None:
        """Remove the adapter's directory."""
        shutil.rmtree(self.adapter_dir, ignore_errors=True)
