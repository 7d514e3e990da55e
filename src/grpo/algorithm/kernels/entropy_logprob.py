"""Fused entropy + selected-token log-prob in one sweep over the vocabulary.

For each row of logits x (V,) and target index y this computes, with an online (streaming)
log-sum-exp over vocabulary blocks,

    m = max_j x_j,  s = sum_j exp(x_j - m),  u = sum_j exp(x_j - m) * x_j
    lse = m + log s,   entropy = lse - u / s,   logp_y = x_y - lse

so neither the softmax nor an fp32 copy of the (rows, V) logits is ever materialised: each
program reads its row once in BLOCK-sized pieces and writes two floats. ``entropy_logprob_torch``
is the reference (and the fallback where Triton cannot run: CPU tensors outside
``TRITON_INTERPRET=1``). On CPU tensors the fallback runs a few rows at a time (``by_row_blocks``), so
its fp32 temporaries stay in the CPU's cache instead of streaming through RAM once per operation
(docs/lab-notebook.md, the bf16 entry, has the figures).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a pinned dependency
    triton = None


def triton_available(device: torch.device | str) -> bool:
    """Triton runs on CUDA tensors, and on CPU tensors under ``TRITON_INTERPRET=1``."""
    if triton is None:
        return False
    device = torch.device(device)
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


CPU_BLOCK_BYTES = 4 << 20
"""The size of one fp32 block of logits that the torch fallback works on at a time on CPU tensors."""


def by_row_blocks(fn, logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """``fn(logits, targets) -> (a, b)`` per row, run on blocks of ``CPU_BLOCK_BYTES`` of fp32 rows
    when the logits are on a CPU (each block a view: in-place work lands in ``logits``), at once on
    GPUs; the per-row outputs concatenated."""
    step = max(1, CPU_BLOCK_BYTES // (4 * logits.shape[-1]))
    if logits.is_cuda or step >= logits.shape[0]:
        return fn(logits, targets)
    parts = [fn(logits[i : i + step], targets[i : i + step]) for i in range(0, logits.shape[0], step)]
    return torch.cat([a for a, _ in parts]), torch.cat([b for _, b in parts])


def use_triton(logits: Tensor, backend: str) -> bool:
    """Whether ``backend`` (``triton``, ``torch`` or ``auto``: triton on CUDA) picks the Triton kernel."""
    return backend == "triton" or (backend == "auto" and logits.is_cuda and triton is not None)


def entropy_logprob_torch(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor]:
    """Reference: logits (R, V) any float dtype, targets (R,) int -> entropy (R,), logp (R,) fp32."""
    x = logits.float()  # (R, V)
    lse = torch.logsumexp(x, dim=-1)  # (R,)
    probs = torch.exp(x - lse.unsqueeze(-1))  # (R, V), the only full-size temporary
    entropy = lse - probs.mul_(x).sum(-1)  # (R,): lse - sum p x, product in place
    logp = x.gather(-1, targets.long().unsqueeze(-1)).squeeze(-1) - lse  # (R,)
    return entropy, logp


if triton is not None:

    @triton.jit
    def _entropy_logprob_kernel(
        logits_ptr, targets_ptr, entropy_ptr, logp_ptr, V, stride_row, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        base = logits_ptr + row.to(tl.int64) * stride_row
        m = tl.zeros((), tl.float32) - float("inf")  # running max
        s = tl.zeros((), tl.float32)  # running sum of exp(x - m)
        u = tl.zeros((), tl.float32)  # running sum of exp(x - m) * x
        for start in range(0, V, BLOCK):
            offs = start + tl.arange(0, BLOCK)
            valid = offs < V
            x = tl.load(base + offs, mask=valid, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            rescale = tl.exp(m - m_new)
            e = tl.where(valid, tl.exp(x - m_new), 0.0)
            s = s * rescale + tl.sum(e, axis=0)
            u = u * rescale + tl.sum(e * tl.where(valid, x, 0.0), axis=0)
            m = m_new
        lse = m + tl.log(s)
        target = tl.load(targets_ptr + row).to(tl.int64)
        x_t = tl.load(base + target).to(tl.float32)
        tl.store(entropy_ptr + row, lse - u / s)
        tl.store(logp_ptr + row, x_t - lse)


def entropy_logprob_triton(logits: Tensor, targets: Tensor, block: int = 4096) -> tuple[Tensor, Tensor]:
    """Triton version of ``entropy_logprob_torch`` (same shapes, fp32 outputs)."""
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    rows, vocab = logits.shape
    entropy = torch.empty(rows, dtype=torch.float32, device=logits.device)
    logp = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows:
        block = min(block, triton.next_power_of_2(vocab))
        _entropy_logprob_kernel[(rows,)](
            logits, targets.contiguous(), entropy, logp, vocab, logits.stride(0), BLOCK=block
        )
    return entropy, logp


def entropy_logprob(logits: Tensor, targets: Tensor, backend: str = "auto") -> tuple[Tensor, Tensor]:
    """Entropy and target log-prob per row; ``backend`` is ``triton``, ``torch`` or ``auto``."""
    if use_triton(logits, backend):
        if not triton_available(logits.device):
            raise RuntimeError("the triton kernel needs CUDA tensors (or TRITON_INTERPRET=1 on the CPU)")
        return entropy_logprob_triton(logits, targets)
    return by_row_blocks(entropy_logprob_torch, logits, targets)
