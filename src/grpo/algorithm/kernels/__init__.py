"""Triton kernels, each with a PyTorch reference that is also its fallback."""

from grpo.algorithm.kernels.entropy_logprob import entropy_logprob, entropy_logprob_torch, triton_available
from grpo.algorithm.kernels.logprob_grad import logprob_grad, logprob_grad_torch

__all__ = ["entropy_logprob", "entropy_logprob_torch", "logprob_grad", "logprob_grad_torch", "triton_available"]
