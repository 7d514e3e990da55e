"""Data-parallel training: the process group and the few collectives the trainer needs.

Contract:

* ``Dist`` describes this process's place in the run (``rank``, ``world_size``, ``local_rank``)
  and wraps the collectives. With ``world_size == 1`` there is no process group and every method
  returns its input (or does nothing): the single-process path runs the same code, unchanged.
* ``init_from_env(device_type, timeout_s)`` reads the variables torch.distributed's launcher
  (``torchrun`` / ``python -m torch.distributed.run``, ``accelerate launch``) sets in each worker
  (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``/``MASTER_PORT``) and joins the
  process group: gloo on CPUs, NCCL on CUDA (one GPU per process: ``cuda:LOCAL_RANK``). Start-up
  (loading the model, starting an engine, resuming: ranks finish these at different times, by
  minutes on a large model) waits up to ``STARTUP_TIMEOUT_S``; ``Dist.start_steps(timeout_s)``, called
  once before the first training step, lowers the bound to ``timeout_s`` (``train.distribution.dist_timeout_s``)
  for every later collective. Then a collective fails after ``timeout_s`` instead of waiting forever
  for a rank that is gone or hangs: it raises ``CollectiveTimeout`` (one line naming this rank and
  the collective); a stage that ends on it exits with ``TIMEOUT_EXIT_CODE`` so its launcher can
  tell a timeout from a crash.
  (Measured with gloo, rank 1 asleep: every collective below gives up after the timeout, +0.1 s.)
* ``launched()`` says whether this process is such a worker (``WORLD_SIZE`` is set);
  ``writes_outputs()`` is the one rule for which process writes a stage's outputs (rank 0).
* ``die_with_parent()``: a worker is killed when its launcher dies (the launcher starts workers
  in sessions of their own, so a ``kill -9`` of the stage's process group would orphan them).

Collectives (every rank must call the same ones in the same order):

    all_reduce(t, op)        (...)   -> (...)      sum / max over ranks, a new tensor
    all_reduce_many(ts, op)  [(...)] -> [(...)]    the same for a list, in one flat all-reduce
    all_gather_cat(t)        (n_r,)  -> (sum n_r,) 1-D tensors of any length, in rank order
    all_gather_object(obj)   obj     -> [obj_0, ..., obj_{W-1}]
    broadcast_object(obj)    obj     -> rank 0's obj
    broadcast_(tensors)      rank 0's values copied into every rank's tensors, in place
    barrier()
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as tdist
from torch._utils import _unflatten_dense_tensors
from torch.distributed.distributed_c10d import _set_pg_timeout  # public since torch 2.2 in all but name

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1
_OPS = {"sum": tdist.ReduceOp.SUM, "max": tdist.ReduceOp.MAX}

TIMEOUT_EXIT_CODE = 124
"""Exit code of a process that stopped on a ``CollectiveTimeout`` (as ``timeout(1)``'s)."""


class CollectiveTimeout(RuntimeError):
    """A collective waited longer than the process group's timeout for the other ranks."""


def launched() -> bool:
    """True inside a worker started by torch.distributed's launcher (or accelerate's)."""
    return "WORLD_SIZE" in os.environ


def writes_outputs(rank: int | None = None) -> bool:
    """Whether the process of global ``rank`` writes a stage's outputs (checkpoints, logs, metrics,
    the adapter, the stage's time): rank 0 alone. ``rank`` defaults to this process's, from the
    launcher's ``RANK`` (0 when not launched: a single process, or the one that launches others)."""
    if rank is None:
        rank = int(os.environ.get("RANK", "0")) if launched() else 0
    return rank == 0


def _is_timeout(err: RuntimeError) -> bool:
    """gloo: "... Timed out waiting 3000ms for recv operation to complete" (measured); NCCL's watchdog
    ("... collective operation timeout ...") usually aborts the process first (SIGABRT)."""
    text = str(err).lower()
    return "timed out" in text or "timeout" in text


def _collective(method):
    """Turn a timeout of the wrapped collective into one ``CollectiveTimeout`` naming the rank, the
    collective and how long it waited (a backend error of another kind propagates unchanged)."""
    @functools.wraps(method)
    def wrapper(self: Dist, *args, **kwargs):
        t0 = time.monotonic()
        try:
            return method(self, *args, **kwargs)
        except RuntimeError as err:
            if not _is_timeout(err):
                raise
            raise CollectiveTimeout(
                f"rank {self.rank}: {method.__name__} timed out after {time.monotonic() - t0:.0f} s waiting for the "
                f"other {self.world_size - 1} process(es): one of them hangs or is gone") from None
    return wrapper


@torch.no_grad()
def _flat_apply(tensors: list[torch.Tensor], collective: Callable[[torch.Tensor], None],
                dtype: torch.dtype | None = None) -> list[torch.Tensor]:
    """``tensors`` (in ``dtype``, default their own) copied into one 1-D buffer (sum of numels,), the
    in-place ``collective`` run once on it, and the result cut back into the inputs' shapes: views
    of that buffer, in order (one collective instead of one per tensor)."""
    flat = torch.cat([t.detach().to(dtype).reshape(-1) for t in tensors])  # (n,): always a copy (unlike
    # _flatten_dense_tensors, which returns a single tensor itself)
    collective(flat)
    return list(_unflatten_dense_tensors(flat, tensors))


@dataclass(frozen=True)
class Dist:
    """This process's rank among ``world_size`` data-parallel processes (see the module docstring)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def active(self) -> bool:
        """More than one process: the collectives do something."""
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        """The one process that writes checkpoints, logs, metrics and the adapter (``writes_outputs``)."""
        return writes_outputs(self.rank)

    def shard(self, n: int) -> slice:
        """The contiguous share of ``n`` items (prompts of a step) of this rank; ``n`` must divide
        by ``world_size`` (``grpo.config.reading`` checks ``prompts_per_step``)."""
        if n % self.world_size:
            raise ValueError(f"{n} items do not split evenly over {self.world_size} processes")
        size = n // self.world_size
        return slice(self.rank * size, (self.rank + 1) * size)

    @_collective
    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Elementwise ``sum`` or ``max`` of ``t`` over ranks (a new tensor; ``t`` is unchanged)."""
        if not self.active:
            return t
        out = t.clone()
        tdist.all_reduce(out, op=_OPS[op])
        return out

    @_collective
    def all_reduce_many(self, tensors: list[torch.Tensor], op: str = "sum",
                        dtype: torch.dtype | None = None) -> list[torch.Tensor]:
        """``all_reduce`` of each of ``tensors`` (in ``dtype``), in one flat all-reduce: new tensors,
        views of one buffer (the inputs unchanged; alone: the inputs in ``dtype``)."""
        if not self.active:
            return [t.to(dtype) for t in tensors]
        return _flat_apply(tensors, functools.partial(tdist.all_reduce, op=_OPS[op]), dtype)

    @_collective
    def all_gather_cat(self, t: torch.Tensor) -> torch.Tensor:
        """The 1-D tensors ``t`` (n_r,) of all ranks, concatenated in rank order: (sum_r n_r,).
        Lengths may differ: each rank pads to the longest, gathers, and the padding is cut off."""
        if not self.active:
            return t
        n = torch.tensor([t.numel()], device=t.device)
        sizes = [torch.zeros_like(n) for _ in range(self.world_size)]
        tdist.all_gather(sizes, n)
        longest = int(max(s.item() for s in sizes))
        padded = torch.zeros(longest, dtype=t.dtype, device=t.device)  # (n_max,)
        padded[: t.numel()] = t.reshape(-1)
        parts = [torch.empty_like(padded) for _ in range(self.world_size)]
        tdist.all_gather(parts, padded)
        return torch.cat([p[: int(s.item())] for p, s in zip(parts, sizes)])

    @_collective
    def all_gather_object(self, obj) -> list:
        """``obj`` of every rank (picklable), in rank order."""
        if not self.active:
            return [obj]
        out = [None] * self.world_size
        tdist.all_gather_object(out, obj)
        return out

    @_collective
    def broadcast_object(self, obj):
        """Rank 0's ``obj`` on every rank."""
        if not self.active:
            return obj
        box = [obj]
        tdist.broadcast_object_list(box, src=0)
        return box[0]

    @_collective
    @torch.no_grad()
    def broadcast_(self, tensors: list[torch.Tensor]) -> None:
        """Copy rank 0's values into ``tensors`` on every rank (one flat collective)."""
        if not self.active or not tensors:
            return
        for t, value in zip(tensors, _flat_apply(tensors, functools.partial(tdist.broadcast, src=0))):
            t.copy_(value)

    @_collective
    def barrier(self) -> None:
        if self.active:
            tdist.barrier()

    def start_steps(self, timeout_s: float) -> None:
        """Once every rank is here (a barrier under the start-up bound), bound every later
        collective by ``timeout_s``: from the first training step on, a rank that waits longer
        than that waits for one that hangs or is gone, not for one that is still loading."""
        if not self.active:
            return
        self.barrier()
        _set_pg_timeout(timedelta(seconds=timeout_s))


STARTUP_TIMEOUT_S = 1800.0
"""How long a collective before the first training step waits for the other ranks (torch's own
default for gloo): loading a base, starting an engine or resuming can keep one rank minutes behind
another, and ``train.distribution.dist_timeout_s`` is meant for a rank that hangs mid-run."""


def init_from_env(device_type: str, timeout_s: float) -> Dist:
    """Join the process group of a launched run (``Dist()`` when not launched or alone), its
    collectives bounded by ``STARTUP_TIMEOUT_S`` (at least ``timeout_s``) until ``Dist.start_steps``.

    ``device_type``: ``cpu`` (gloo) or ``cuda`` (NCCL; selects ``cuda:LOCAL_RANK`` first).
    """
    if not launched():
        return Dist()
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    if world == 1:
        return Dist()
    backend = "nccl" if device_type == "cuda" else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(local)
    startup = max(timeout_s, STARTUP_TIMEOUT_S)
    tdist.init_process_group(backend=backend, timeout=timedelta(seconds=startup))
    log.info("rank %d of %d (%s, collective timeout %.0f s from the first step, %.0f s before)", rank, world, backend,
             timeout_s, startup)
    return Dist(rank, world, local)


def shutdown(dist: Dist) -> None:
    """Leave the process group (no-op for a single process)."""
    if dist.active and tdist.is_initialized():
        tdist.destroy_process_group()


LAUNCHER_PID = "GRPO_LAUNCHER_PID"
"""Set by ``grpo.training.launcher`` for its workers: the pid of the process that launched them."""


def die_with_parent() -> None:
    """Have the kernel kill this process when its parent (the launcher) dies (Linux; elsewhere a
    no-op). If the launcher named in ``GRPO_LAUNCHER_PID`` is already gone, exit now."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):
        return
    expected = os.environ.get(LAUNCHER_PID)
    if expected and os.getppid() != int(expected):  # re-parented: the launcher died before prctl
        os._exit(1)
