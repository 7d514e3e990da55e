"""Tracing the real code on fake CUDA tensors (import after ``fake_cuda.load()``; README.md here).

``patch_torch``: what the project's code needs to run on ``FakeTensorMode`` "cuda" tensors;
``DataDependent``: fixed answers where an op's result depends on values; ``LiveBytes``: live
CUDA storage bytes per phase and the tensors live at the peak.
"""

from __future__ import annotations

import importlib
import math
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten


def patch_torch() -> None:
    """What the real code needs to run on fake CUDA tensors (README.md here): ``Module.to`` on fake
    parameters, the Triton launches replaced by their outputs, SDPA as a CUDA GPU runs it."""
    swap = torch.utils.swap_tensors

    def swap_or_set(t1, t2):  # Module.to() swaps parameters, which refuses a fake one (it has a weakref)
        try:
            swap(t1, t2)
        except RuntimeError as err:
            if "weakref" not in str(err):
                raise
            with torch.no_grad():
                t1.data = t2.data
            t1.fake_device = t2.fake_device

    torch.utils.swap_tensors = swap_or_set
    kernel = importlib.import_module("grpo.algorithm.kernels.entropy_logprob")

    def triton_outputs(logits, targets, block=4096):  # the launch replaced: the kernel's two outputs
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        rows = logits.shape[0]
        return (torch.empty(rows, dtype=torch.float32, device=logits.device),
                torch.empty(rows, dtype=torch.float32, device=logits.device))

    kernel.entropy_logprob_triton = triton_outputs
    # the LM head's kernel writes its gradient over the logits: its launch leaves two fp32 outputs
    importlib.import_module("grpo.algorithm.kernels.logprob_grad").logprob_grad_triton = triton_outputs
    torch.nn.functional.scaled_dot_product_attention = sdpa_as_on_cuda


def sdpa_as_on_cuda(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """The kernel torch's CUDA dispatcher picks for bf16, head_dim <= 256 on sm80+: flash attention
    without a mask, memory-efficient attention with one."""
    aten = torch.ops.aten
    if enable_gqa and key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], 1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], 1)
    if attn_mask is None:
        return aten._scaled_dot_product_flash_attention(query, key, value, dropout_p, is_causal, scale=scale)[0]
    if attn_mask.dtype == torch.bool:  # an additive mask in the query dtype, as SDPA converts it
        attn_mask = torch.where(attn_mask.logical_not(), float("-inf"), 0.0).to(query.dtype)
    bias = attn_mask.expand(query.shape[0], query.shape[1], query.shape[2], key.shape[2])
    lse = query.requires_grad or key.requires_grad or value.requires_grad
    return aten._scaled_dot_product_efficient_attention(query, key, value, bias, lse, dropout_p, is_causal,
                                                        scale=scale)[0]


class DataDependent(TorchDispatchMode):
    """Fixed answers where an op's result depends on tensor values (see the module docstring)."""

    def __init__(self, keep: float):
        super().__init__()
        self.keep, self.hits = keep, {}
        self.full_length: int | None = None  # set inside a decode loop (``decoding``)

    def decoding(self, max_new_tokens: int):
        """Inside the block (a decode loop): booleans True (every row has ended at the loop's first
        check: its shapes are fixed, so later steps allocate as those did) and numbers
        ``max_new_tokens`` (every completion full length)."""
        import contextlib

        @contextlib.contextmanager
        def block():
            before, self.full_length = self.full_length, max_new_tokens
            try:
                yield
            finally:
                self.full_length = before

        return block()

    def _count(self, name):
        self.hits[name] = self.hits.get(name, 0) + 1

    def _k(self, mask) -> int:
        return max(1, math.ceil(self.keep * mask.numel()))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        kwargs = kwargs or {}
        if func is aten._local_scalar_dense.default:
            self._count(".item()")
            t = args[0]
            if self.full_length is not None:
                return True if t.dtype == torch.bool else self.full_length
            return False if t.dtype == torch.bool else (1.0 if t.is_floating_point() else 1)
        if func is aten.equal.default:
            self._count("equal")
            return True
        if func is aten.nonzero.default:
            self._count("nonzero")
            return torch.empty((self._k(args[0]), args[0].dim()), dtype=torch.long, device=args[0].device)
        if func is aten.masked_select.default:
            self._count("masked_select")
            t, m = args
            return torch.empty((self._k(torch.broadcast_tensors(t, m)[1]),), dtype=t.dtype, device=t.device)
        if func in (aten.index.Tensor, aten.index_put_.default, aten.index_put.default, aten._index_put_impl_.default):
            if any(i is not None and i.dtype == torch.bool for i in args[1]):
                self._count("boolean index")
                new = []
                for i in args[1]:
                    if i is not None and i.dtype == torch.bool:
                        new += [torch.empty((self._k(i),), dtype=torch.long, device=i.device)] * i.dim()
                    else:
                        new.append(i)
                return func(args[0], new, *args[2:], **kwargs)
        return func(*args, **kwargs)


class LiveBytes(TorchDispatchMode):
    """Live bytes of CUDA storages (each rounded up to 512 B), the peak of each phase, and the
    tensors live at the overall peak."""

    ROUND = 512

    def __init__(self, resident=()):
        super().__init__()
        self.live, self.info, self.cur, self.phase, self.op = {}, {}, 0, "resident", ""
        self.on_reset, self.phase_peak, self.peak, self.snap_at = [], {}, 0, 0
        self.window = 0  # the most bytes live since open_window()
        for t in resident:
            self._add(t)
        self.reset()

    def reset(self) -> None:
        """Start the figures afresh: what is live now counts as resident."""
        self.resident = self.cur
        self.info = {k: ("resident", *v[1:]) for k, v in self.info.items()}
        self.peak, self.peak_phase, self.phase_peak, self.snap, self.snap_at = self.cur, "resident", {}, [], 0
        for fn in self.on_reset:
            fn()

    def open_window(self) -> None:
        """Start ``window``, the most bytes live from now on."""
        self.window = self.cur

    def _add(self, t) -> None:
        if not isinstance(t, torch.Tensor) or t.device.type != "cuda":
            return
        storage = t.untyped_storage()
        key = id(storage)
        if key in self.live:
            return
        nbytes = math.ceil(storage.nbytes() / self.ROUND) * self.ROUND

        def gone(_ref, key=key, nbytes=nbytes):
            if self.live.pop(key, None) is not None:
                self.cur -= nbytes
                self.info.pop(key, None)

        self.live[key] = weakref.ref(storage, gone)
        self.cur += nbytes
        self.window = max(self.window, self.cur)
        self.info[key] = (self.phase, self.op, tuple(t.shape), str(t.dtype).removeprefix("torch."), nbytes)
        if self.cur > self.phase_peak.get(self.phase, 0):
            self.phase_peak[self.phase] = self.cur
        if self.cur > self.peak:
            self.peak = self.cur
            if self.cur - self.snap_at > max(4096, self.peak // 2000):  # the tensors live now (sampled)
                self.snap, self.snap_at, self.peak_phase = list(self.info.values()), self.cur, self.phase

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.op = func.overloadpacket.__name__
        for t in tree_flatten(out)[0]:
            self._add(t)
        return out
