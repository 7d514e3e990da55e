"""Target log-prob and its gradient with respect to the logits, written over the logits.

For each row of logits x (V,) and target index y this computes

    lse = log sum_j exp(x_j),   logp_y = x_y - lse,   d logp_y / d x = onehot(y) - softmax(x)

and writes the gradient into the logits' own storage (in their dtype), so the only (rows, V)
tensor is the logits themselves: the LM head with grad (``grpo.algorithm.logprobs.selected_logprobs``) needs
no fp32 copy of them. The Triton kernel sweeps each row twice (an online log-sum-exp, then the
gradient), with fp32 arithmetic in registers. ``logprob_grad_torch`` is the reference and the
fallback; it works in place on fp32 logits and on one fp32 copy of lower-precision ones, on CPU
tensors a few rows at a time (``by_row_blocks``, as ``entropy_logprob``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.algorithm.kernels.entropy_logprob import by_row_blocks, triton, triton_available, use_triton

if triton is not None:
    import triton.language as tl


def logprob_grad_torch(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: logits (R, V) any float dtype (overwritten by the gradient), targets (R,) int ->
    lse (R,), logp (R,) fp32."""
    t = targets.long().unsqueeze(-1)  # (R, 1)
    x_t = logits.gather(-1, t).squeeze(-1).float()  # (R,)
    x = logits.float()  # (R, V): the logits themselves when fp32, else the one copy
    m = x.amax(-1, keepdim=True)  # (R, 1)
    x.sub_(m).exp_()
    s = x.sum(-1, keepdim=True)  # (R, 1)
    lse = (m + s.log()).squeeze(-1)  # (R,)
    x.div_(s).neg_().scatter_add_(-1, t, torch.ones_like(s))  # onehot - softmax
    if x.data_ptr() != logits.data_ptr():
        logits.copy_(x)
    return lse, x_t - lse


if triton is not None:

    @triton.jit
    def _logprob_grad_kernel(logits_ptr, targets_ptr, lse_ptr, logp_ptr, V, stride_row, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride_row
        m = tl.zeros((), tl.float32) - float("inf")  # running max
        s = tl.zeros((), tl.float32)  # running sum of exp(x - m)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            x = tl.load(base + offs, mask=valid, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            s = s * tl.exp(m - m_new) + tl.sum(tl.where(valid, tl.exp(x - m_new), 0.0), axis=0)
            m = m_new
        lse = m + tl.log(s)
        target = tl.load(targets_ptr + row).to(tl.int64)
        x_t = tl.load(base + target).to(tl.float32)
        tl.store(lse_ptr + row, lse)
        tl.store(logp_ptr + row, x_t - lse)
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            x = tl.load(base + offs, mask=valid, other=0.0).to(tl.float32)
            grad = tl.where(offs == target, 1.0, 0.0) - tl.exp(x - lse)
            tl.store(base + offs, grad.to(logits_ptr.dtype.element_ty), mask=valid)


def logprob_grad_triton(logits: Tensor, targets: Tensor, block: int = 4096) -> tuple[Tensor, Tensor]:
    """Triton version of ``logprob_grad_torch`` (logits with unit stride along V)."""
    if logits.stride(-1) != 1:
        raise ValueError("logprob_grad_triton: the logits must have unit stride along the vocabulary")
    rows, vocab = logits.shape
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        block = min(block, triton.next_power_of_2(vocab))
        _logprob_grad_kernel[(rows,)](logits, targets.contiguous(), lse, logp, vocab, logits.stride(0), BLOCK=block)
    return lse, logp


def logprob_grad(logits: Tensor, targets: Tensor, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """lse and target log-prob per row, the logits overwritten by ``onehot - softmax``; ``backend``
    is ``triton``, ``torch`` or ``auto``."""
    if use_triton(logits, backend):
        if not triton_available(logits.device):
            raise RuntimeError("the triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
        return logprob_grad_triton(logits, targets)
    return by_row_blocks(logprob_grad_torch, logits, targets)
