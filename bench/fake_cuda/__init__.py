"""A fake CUDA device for ``FakeTensorMode`` on a CPU-only PyTorch (see README.md here).

``load()`` builds ``guard.cpp`` against the torch wheel's headers with
``torch.utils.cpp_extension.load`` (in a child process, cached under ``~/.cache/torch_extensions``)
and loads it into this process BEFORE torch is imported: torch reads its CUDA hooks once, when
it first asks for them, so a library loaded after ``import torch`` comes too late.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SOURCE = Path(__file__).with_name("guard.cpp")
NAME = "grpo_fake_cuda"
_BUILD = (
    "import sys\n"
    "from torch.utils.cpp_extension import load\n"
    f"print(load({NAME!r}, [sys.argv[1]], is_python_module=False, extra_cflags=['-O1']))\n"
)


def build() -> Path:
    """The shim's shared library, built on first use (g++ and ninja; seconds) and cached."""
    out = subprocess.run([sys.executable, "-c", _BUILD, str(SOURCE)], capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{SOURCE}: the build failed: {out.stderr.strip().splitlines()[-1:]}")
    return Path(out.stdout.strip().splitlines()[-1])


def load() -> Path:
    """Build (if needed) and load the shim; then ``import torch`` sees a CUDA device guard and CUDA
    hooks, and autograd runs on fake "cuda" tensors. Raises when torch is already imported."""
    if "torch" in sys.modules:
        raise RuntimeError("fake_cuda.load() must run before `import torch` (torch caches its CUDA hooks)")
    lib = build()
    torch_lib = Path(importlib.util.find_spec("torch").submodule_search_locations[0]) / "lib"
    for dep in ("libc10.so", "libtorch_cpu.so"):  # the shim links against them: load torch's own first
        ctypes.CDLL(os.fspath(torch_lib / dep), mode=ctypes.RTLD_GLOBAL)
    shim = ctypes.CDLL(os.fspath(lib), mode=ctypes.RTLD_GLOBAL)
    import torch  # noqa: F401  (now its CUDA hooks are the shim's)

    if shim.fake_cuda_ready() != 1:
        raise RuntimeError(f"{lib}: loaded, but torch does not see the fake CUDA device")
    return lib
