"""The keys every section that starts a vLLM engine has (``sent``, ``evaluate``, ``train``)."""

from __future__ import annotations

from grpo.core.fields import Fraction, Positive, Section


class VLLMEngineConfig(Section):
    """Fields shared by the sections that start a vLLM engine."""

    gpu_memory_utilization: Fraction = 0.5
    """vLLM: fraction of GPU memory (on CPUs: of the NUMA node's RAM) for weights and KV cache; too
    little KV cache makes the engine preempt and recompute sequences. On a CPU the train engine's KV
    cache is one generation call's instead (``grpo.rollout.engine.bounds.train_bounds``) and the
    share is what ``grpo.rollout.engine.policy_engine.check_engine_memory`` checks for N processes."""
    max_model_len: Positive = 1024
    """vLLM: longest prompt + completion the engine accepts."""
