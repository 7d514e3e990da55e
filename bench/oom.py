"""An out-of-memory error as figures: what a bench script records when an allocation fails, so that
the device check reports the phase as failed with the bytes asked for (never as passed).

Two allocators raise it: CUDA's caching allocator (``torch.OutOfMemoryError``, its message "CUDA out
of memory. Tried to allocate 2.00 GiB. ...", sizes as c10's ``format_size`` writes them: bytes,
KiB, MiB, GiB) and the CPU's (a ``RuntimeError`` "DefaultCPUAllocator: can't allocate memory: you
tried to allocate N bytes"). ``oom_figure`` reads either; any other error is not an OOM.
"""

from __future__ import annotations

import re

_UNITS = {"bytes": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40, "PiB": 2**50}
_CUDA = re.compile(r"Tried to allocate ([\d.]+) (bytes|KiB|MiB|GiB|TiB|PiB)")
_CPU = re.compile(r"you tried to allocate (\d+) bytes")
SCHEMA = {
    "oom": "bool?: the call ran out of memory (CUDA's or the CPU's allocator); null: it did not fail",
    "requested_gib": "number?: the allocation that failed, from the error's message",
    "allocated_gib": "number?: CUDA's memory_allocated when it failed (null on a CPU)",
    "peak_allocated_gib": "number?: CUDA's max_memory_allocated when it failed (null on a CPU)",
}


def requested_bytes(message: str) -> int | None:
    """The bytes an out-of-memory message says were asked for; None when it is not one."""
    if found := _CUDA.search(message):
        return round(float(found.group(1)) * _UNITS[found.group(2)])
    if found := _CPU.search(message):
        return int(found.group(1))
    return None


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is an allocator's out-of-memory error (CUDA's type, or the CPU allocator's message)."""
    import torch

    return isinstance(err, torch.OutOfMemoryError) or (isinstance(err, RuntimeError)
                                                       and requested_bytes(str(err)) is not None)


def oom_figure(err: BaseException) -> dict | None:
    """``SCHEMA``'s figures of ``err`` when it is an out-of-memory error (read at once, before the
    caller frees anything: CUDA's counters still hold the failed call's), else None."""
    if not is_oom(err):
        return None
    import torch

    asked = requested_bytes(str(err))
    cuda = torch.cuda.is_available() and torch.cuda.is_initialized()
    return {"oom": True, "requested_gib": None if asked is None else round(asked / 2**30, 3),
            "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 3) if cuda else None,
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 3) if cuda else None}


def describe(stage: str, figure: dict, cap_gib: float | None) -> str:
    """One line naming an out-of-memory failure and its figures (a device check phase's ``why``);
    ``figure``: ``SCHEMA``'s keys, and ``predicted_gib`` where the caller had a prediction."""
    shown = {"requested_gib": "asked for {} GiB", "allocated_gib": "{} GiB allocated", "peak_allocated_gib": "peak {} GiB",
             "predicted_gib": "predicted {} GiB"}
    parts = [text.format(figure[k]) for k, text in shown.items() if figure.get(k) is not None]
    parts += [f"cap {cap_gib} GiB"] if cap_gib else []
    return f"out of memory in {stage}: " + ", ".join(parts)
