"""The fused Triton kernels against their PyTorch references: entropy + log-prob, and the target
log-prob with its gradient written over the logits.

On the CPU the kernel runs under ``TRITON_INTERPRET=1`` (set in conftest.py); on CUDA, natively
(marked ``cuda``: ``bench/device_check.py`` runs them on a GPU). The 16-bit inputs are the card's
16-bit dtype (the ``half_dtype`` fixture: fp16 below compute capability 8.0, bf16 from 8.0 and on
the CPU).
"""

from __future__ import annotations

import pytest
import torch

from grpo.algorithm.entropy import token_entropy
from grpo.algorithm.kernels import entropy_logprob, entropy_logprob_torch, triton_available
from grpo.algorithm.kernels.entropy_logprob import entropy_logprob_triton
from grpo.algorithm.kernels.logprob_grad import logprob_grad, logprob_grad_torch, logprob_grad_triton
from grpo.algorithm.logprobs import chunked_entropy_logprobs, selected_logprobs

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not triton_available(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")]


@pytest.mark.parametrize(("rows", "vocab", "block"), [(4, 1000, 256), (3, 517, 128), (2, 64, 64), (5, 3000, 4096)])
def test_kernel_matches_reference_fp32(rows, vocab, block):
    torch.manual_seed(rows * vocab)
    logits = (torch.randn(rows, vocab) * 4).to(DEVICE)
    targets = torch.randint(0, vocab, (rows,), device=DEVICE)
    ent_ref, logp_ref = entropy_logprob_torch(logits, targets)
    ent, logp = entropy_logprob_triton(logits, targets, block=block)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-5)
    # and the reference itself agrees with the pure entropy function
    torch.testing.assert_close(ent_ref, token_entropy(logits))


def test_kernel_half_input(half_dtype):
    torch.manual_seed(0)
    logits = (torch.randn(6, 2048) * 3).to(half_dtype).to(DEVICE)
    targets = torch.randint(0, 2048, (6,), device=DEVICE)
    ent_ref, logp_ref = entropy_logprob_torch(logits, targets)  # fp32 math on the same 16-bit values
    ent, logp = entropy_logprob(logits, targets, backend="triton")
    torch.testing.assert_close(ent, ent_ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-4, atol=1e-4)


def test_kernel_non_contiguous_rows():
    torch.manual_seed(1)
    big = torch.randn(8, 300, device=DEVICE)
    logits = big[::2, :257]  # strided rows, a column slice
    targets = torch.randint(0, 257, (4,), device=DEVICE)
    ent, logp = entropy_logprob_triton(logits, targets, block=64)
    ent_ref, logp_ref = entropy_logprob_torch(logits, targets)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("backend", ["torch", "triton"])
def test_chunked_pass_equals_full_log_softmax(backend):
    torch.manual_seed(2)
    head = torch.nn.Linear(16, 50, bias=False).to(DEVICE)
    hidden = torch.randn(3, 7, 16, device=DEVICE)  # (N, C, H)
    targets = torch.randint(0, 50, (3, 7), device=DEVICE)
    ent, logp = chunked_entropy_logprobs(hidden, head, targets, chunk=5, backend=backend)
    logits = head(hidden)
    full = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(logp, full, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ent, token_entropy(logits), rtol=1e-5, atol=1e-5)
    # the grad path at a subset of rows gives the same values, and gradients
    keep = torch.rand(3, 7, device=DEVICE) > 0.5
    h = hidden.clone().requires_grad_(True)
    sel = selected_logprobs(h[keep], head, targets[keep], 4, backend)
    torch.testing.assert_close(sel, full[keep], rtol=1e-5, atol=1e-5)
    sel.sum().backward()
    assert (h.grad[~keep] == 0).all() and (h.grad[keep].abs().sum(-1) > 0).all()


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (too slow in the interpreter)")
def test_kernel_at_qwen2_vocab_on_cuda(half_dtype):
    """16-bit logits at Qwen2's vocabulary (151,936), the size the kernel is for."""
    torch.manual_seed(3)
    vocab = 151936
    logits = (torch.randn(64, vocab, device=DEVICE) * 3).to(half_dtype)
    targets = torch.randint(0, vocab, (64,), device=DEVICE)
    ent_ref, logp_ref = entropy_logprob_torch(logits, targets)
    ent, logp = entropy_logprob(logits, targets, backend="auto")  # auto picks Triton on CUDA
    torch.testing.assert_close(ent, ent_ref, rtol=1e-4, atol=1e-3)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-4, atol=1e-3)


def autograd_logprob_grad(logits, targets):
    """lse, logp and d logp / d logits of the fp32 log-softmax, through autograd."""
    x = logits.float().detach().requires_grad_(True)
    logp = torch.log_softmax(x, -1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)
    logp.sum().backward()
    return torch.logsumexp(x.detach(), -1), logp.detach(), x.grad


@pytest.mark.parametrize(("rows", "vocab", "block"), [(4, 1000, 256), (3, 517, 128), (2, 64, 64), (5, 3000, 4096)])
def test_logprob_grad_kernels_match_autograd_fp32(rows, vocab, block):
    """Both versions give the lse, the log-prob and, over the logits, the gradient of log-softmax."""
    torch.manual_seed(rows + vocab)
    logits = (torch.randn(rows, vocab) * 4).to(DEVICE)
    targets = torch.randint(0, vocab, (rows,), device=DEVICE)
    lse_ref, logp_ref, grad_ref = autograd_logprob_grad(logits, targets)
    for run in (logprob_grad_torch, lambda x, t: logprob_grad_triton(x, t, block=block)):
        x = logits.clone()
        lse, logp = run(x, targets)
        torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(x, grad_ref, rtol=1e-5, atol=1e-6)


def test_logprob_grad_half_in_place(half_dtype):
    """16-bit logits: fp32 arithmetic, the gradient rounded once to 16 bits in the logits' storage."""
    torch.manual_seed(6)
    logits = (torch.randn(6, 2048) * 3).to(half_dtype).to(DEVICE)
    targets = torch.randint(0, 2048, (6,), device=DEVICE)
    lse_ref, logp_ref, grad_ref = autograd_logprob_grad(logits, targets)
    for backend in ("torch", "triton"):
        x = logits.clone()
        ptr = x.data_ptr()
        lse, logp = logprob_grad(x, targets, backend)
        assert x.data_ptr() == ptr and x.dtype == half_dtype
        torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-5)
        ulp = torch.finfo(half_dtype).eps  # one ulp relative (the interpreter truncates): 2**-7 bf16, 2**-10 fp16
        torch.testing.assert_close(x.float(), grad_ref, rtol=ulp, atol=1e-6)


@pytest.mark.skipif(DEVICE != "cuda", reason="needs CUDA (too slow in the interpreter)")
def test_logprob_grad_at_qwen2_vocab_on_cuda(half_dtype):
    """16-bit logits at Qwen2's vocabulary: the Triton kernel against the PyTorch version."""
    torch.manual_seed(7)
    vocab = 151936
    logits = (torch.randn(64, vocab, device=DEVICE) * 3).to(half_dtype)
    targets = torch.randint(0, vocab, (64,), device=DEVICE)
    ref, out = logits.clone(), logits.clone()
    lse_ref, logp_ref = logprob_grad_torch(ref, targets)
    lse, logp = logprob_grad(out, targets, backend="auto")  # auto picks Triton on CUDA
    torch.testing.assert_close(lse, lse_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(out.float(), ref.float(), rtol=torch.finfo(half_dtype).eps, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_fallbacks_in_row_blocks_equal_one_pass(dtype):
    """On CPU tensors the torch fallbacks run a few rows at a time (``by_row_blocks``): the same
    values, and the same gradient written over the logits, as one pass over every row."""
    from grpo.algorithm.kernels.entropy_logprob import CPU_BLOCK_BYTES

    vocab = CPU_BLOCK_BYTES // 4 // 3  # 3 rows a block: 10 rows make 4 blocks, the last partial
    torch.manual_seed(1)
    logits = (torch.randn(10, vocab) * 4).to(dtype)
    targets = torch.randint(0, vocab, (10,))
    ent, logp = entropy_logprob(logits, targets, "torch")
    ent_ref, logp_ref = entropy_logprob_torch(logits, targets)
    torch.testing.assert_close(ent, ent_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-6, atol=1e-6)
    blocked, whole = logits.clone(), logits.clone()
    lse, logp = logprob_grad(blocked, targets, "torch")
    lse_ref, logp_ref = logprob_grad_torch(whole, targets)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(logp, logp_ref, rtol=1e-6, atol=1e-6)
    assert not torch.equal(blocked, logits)  # the gradient was written over the logits ...
    torch.testing.assert_close(blocked, whole)  # ... in every block
