"""Triton kernels, each with a PyTorch reference that is also its fallback."""

from grpo.kernels.entropy_logprob import entropy_logprob, entropy_logprob_torch, triton_available

__all__ = ["entropy_logprob", "entropy_logprob_torch", "triton_available"]
