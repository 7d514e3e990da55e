"""Device and dtype policy, in one place.

* ``default_device()``: ``cuda`` when a CUDA device is visible, else ``cpu``.
* ``compute_dtype(setting, device)``: the training/evaluation compute dtype for a ``model.dtype``
  setting: ``auto`` is bf16 on CUDA and fp32 on CPUs (bf16 matmuls are slow on CPUs without
  native bf16 instructions, and training there stays in fp32 on every CPU for one behaviour).
* ``sampling_dtype(setting, device)``: the sampler's dtype for a ``sent.dtype`` setting: ``auto``
  is bf16 on CUDA and on CPUs with native bf16 (AVX512-BF16 or AMX-BF16), fp32 on other CPUs.
"""

from __future__ import annotations

import os
import platform
from pathlib import Path

import torch


def default_device() -> str:
    """``cuda`` when available, else ``cpu``."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def describe_device() -> str:
    """One line naming the device this process computes on (for reports)."""
    if default_device() == "cuda":
        return f"CUDA: {torch.cuda.get_device_name(0)}"
    cores = len(os.sched_getaffinity(0))
    return f"CPU: {platform.processor() or platform.machine()}, {cores} cores, torch threads {torch.get_num_threads()}"


def compute_dtype(setting: str, device: str | torch.device) -> torch.dtype:
    """``bfloat16`` / ``float32`` as named; ``auto``: bf16 on CUDA, fp32 on CPUs."""
    if setting == "auto":
        return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
    return getattr(torch, setting)


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True when the CPU flags list AVX512-BF16 or AMX-BF16 (False where they cannot be read)."""
    try:
        flags = Path(cpuinfo).read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def sampling_dtype(setting: str, device: str | torch.device) -> str:
    """The sampler's dtype name: an explicit one as given; ``auto``: ``bfloat16`` on CUDA and on
    CPUs with native bf16, ``float32`` on CPUs without it (slow bf16 kernels there; the README's
    SENT speed table has the figures)."""
    if setting != "auto":
        return setting
    native = torch.device(device).type == "cuda" or cpu_has_native_bf16()
    return "bfloat16" if native else "float32"
