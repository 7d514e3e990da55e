"""The preflight of a GPU machine (``grpo doctor``): what the first CUDA run needs, one line each.

Nobody has run this project on a GPU yet (docs/gpu-notes.md). The ways a first run is known to die
late, with a deep traceback, are checked here first, each with its fix. The library lines behind
each check: docs/gpu-notes.md, vLLM source map: preflight.

* ``driver``: the NVIDIA driver against what the installed torch build's CUDA needs (torch 2.13's
  wheels are CUDA 13.0 only: driver branch 580 or newer; the table is ``grpo.core.device.MIN_DRIVER``,
  from NVIDIA's CUDA toolkit / driver compatibility table). Read from the kernel module, so it
  works where torch sees no GPU at all.
* ``cuda``: whether torch sees a usable GPU at all (``torch.cuda.is_available()``).
* ``capability``: the card's compute capability against ``torch.cuda.get_arch_list()`` and the floor
  7.5 (``CAPABILITY_FLOOR``): a GTX 10xx (6.1) passes ``is_available()`` and fails at its first
  kernel. Below 8.0 compute is fp16 (``grpo.core.device.cuda_half_dtype``), which has never run: a warning.
* ``compiler`` and ``python headers``: Triton compiles a small C launcher at the first launch of every
  kernel (the LoRA kernels, the sampler, sm75 attention, the project's own kernel) with ``$CC``, else
  ``gcc``, else ``clang``, against ``Python.h`` of ``sysconfig.get_paths(scheme)["include"]``; vLLM
  compiles two sampler helpers with Inductor (``torch.compile``) in the process that holds the
  engine, the training process included, even with ``enforce_eager`` (docs/gpu-notes.md, vLLM
  source map: preflight).
* ``gpu memory``: free memory (``torch.cuda.mem_get_info``) against an estimate in bytes that the
  caller gives (``grpo check --device cuda`` prints the step's).
* ``flashinfer sampler``: vLLM 0.32 turns FlashInfer's top-k/top-p sampler on by default on CUDA and
  FlashInfer compiles it with nvcc at engine start, which torch's wheels do not ship (vLLM issue
  49497). Every engine the project starts sets ``VLLM_USE_FLASHINFER_SAMPLER=0`` unless the user set
  it (``grpo.rollout.engine.args.start_environment``); the line says which, and stops a value vLLM cannot
  read or a sampler that cannot be compiled here.

Each probe of the machine is a small function (``probe_*``) so a test can make it fail; each check
is a pure function of what the probes found. ``run_preflight(estimate_bytes)`` runs them all and
returns a ``Preflight``: its ``lines()`` and, where a check is a blocker, ``error_line()`` (one
line naming it) and ``raise_for_blockers()`` (``DeviceError``). On a CPU build of torch it checks
nothing and says so.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from grpo.core.errors import DeviceError

OK, WARN, BLOCKER, SKIP = "ok", "warn", "BLOCKER", "skip"

CAPABILITY_FLOOR = (7, 5)
"""The oldest compute capability the CUDA path has kernels for: bitsandbytes 0.50.2's cuda130
library (sm75-sm120), vLLM 0.32's Marlin 4-bit kernels and its wheel's fatbin start at 7.5
(docs/gpu-notes.md, vLLM source map: preflight)."""

DRIVER_VERSION_FILE = Path("/proc/driver/nvidia/version")
"""Where the NVIDIA kernel module states its version (readable without a CUDA context)."""

FLASHINFER_SAMPLER_ENV = "VLLM_USE_FLASHINFER_SAMPLER"
"""vLLM's switch of the FlashInfer top-k/top-p sampler (on by default on CUDA in 0.32; the project's
engines set it to 0 unless the user set it: ``grpo.rollout.engine.args.start_environment``)."""

WOULD_CHECK = ("the NVIDIA driver against torch's CUDA (13.0 needs 580+), the card's compute capability "
               "against torch.cuda.get_arch_list() and 7.5, a C compiler and Python.h for Triton, free GPU "
               f"memory against the step's estimate, {FLASHINFER_SAMPLER_ENV}")


@dataclass(frozen=True)
class Check:
    level: str  # ok | warn | BLOCKER | skip
    name: str  # what was checked: driver, cuda, capability, compiler, python headers, gpu memory, flashinfer sampler
    message: str  # what was found and, unless ok, what to do

    def line(self) -> str:
        return f"{self.level:<7} {self.name:<18} {self.message}"


@dataclass
class Preflight:
    header: str
    checks: list[Check] = field(default_factory=list)

    @property
    def blockers(self) -> list[Check]:
        return [c for c in self.checks if c.level == BLOCKER]

    def lines(self) -> list[str]:
        return [self.header, *(c.line() for c in self.checks)]

    def error_line(self) -> str | None:
        """One line naming the blocker (the first, and how many more), or None."""
        found = self.blockers
        if not found:
            return None
        first = f"{found[0].name}: {found[0].message}"
        if len(found) == 1:
            return first
        return f"{len(found)} blockers ({', '.join(c.name for c in found)}); first: {first}"

    def raise_for_blockers(self) -> None:
        """``DeviceError`` with ``error_line()`` where a check is a blocker (for the pipeline's stages)."""
        line = self.error_line()
        if line is not None:
            raise DeviceError(f"GPU preflight: {line}")


# ------------------------------------------------------------------------------------- probes
def probe_torch() -> tuple[str, str | None]:
    """torch's version and the CUDA version it is built for (None: a CPU build)."""
    import torch

    return torch.__version__, torch.version.cuda


def probe_cuda_usable() -> bool:
    import torch

    return torch.cuda.is_available()


def probe_driver() -> str | None:
    """The NVIDIA kernel driver's version (``580.65.06``), or None where no driver is found. Read
    from ``/proc/driver/nvidia/version`` (no CUDA context needed), else from ``nvidia-smi``."""
    try:
        found = re.search(r"Kernel Module(?: for \w+)?\s+(\d+\.\d+(?:\.\d+)?)", DRIVER_VERSION_FILE.read_text())
        if found:
            return found.group(1)
    except OSError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=driver_version", "--format=csv,noheader"], capture_output=True,
                             text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    first = out.stdout.strip().splitlines()[0].strip() if out.returncode == 0 and out.stdout.strip() else ""
    return first or None


def probe_device() -> tuple[str, tuple[int, int]]:
    """The name and compute capability of CUDA device 0."""
    import torch

    return torch.cuda.get_device_name(0), tuple(torch.cuda.get_device_capability(0))


def probe_arch_list() -> list[str]:
    """The architectures the installed torch is compiled for (``sm_75``, ..., ``compute_120``)."""
    import torch

    return list(torch.cuda.get_arch_list())


def probe_compiler(environ: Mapping[str, str]) -> str | None:
    """The C compiler Triton would use (``$CC``, else gcc, else clang), or None. ``$CC`` counts only
    where it names an executable."""
    cc = environ.get("CC")
    if cc:
        return shutil.which(cc)
    return shutil.which("gcc") or shutil.which("clang")


def probe_python_include() -> Path:
    """The directory Triton passes as ``-I`` for ``Python.h`` (the default scheme's, Debian's
    ``posix_local`` read as ``posix_prefix``)."""
    scheme = sysconfig.get_default_scheme()
    if scheme == "posix_local":  # Debian's scheme; Triton reads posix_prefix's headers
        scheme = "posix_prefix"
    return Path(sysconfig.get_paths(scheme=scheme)["include"])


def probe_free_memory() -> tuple[int, int]:
    """Free and total bytes of CUDA device 0."""
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return int(free), int(total)


def probe_nvcc(environ: Mapping[str, str]) -> str | None:
    """nvcc where FlashInfer looks for it: ``$CUDA_HOME`` or ``$CUDA_PATH``, else ``which nvcc``, else
    /usr/local/cuda."""
    home = environ.get("CUDA_HOME") or environ.get("CUDA_PATH")
    candidates = [Path(home) / "bin" / "nvcc"] if home else []
    on_path = shutil.which("nvcc")
    candidates += [Path(on_path)] if on_path else []
    candidates.append(Path("/usr/local/cuda/bin/nvcc"))
    return next((str(p) for p in candidates if p.is_file() and os.access(p, os.X_OK)), None)


def probe_flashinfer_jit_cache() -> bool:
    """Whether FlashInfer's prebuilt kernels (``flashinfer-jit-cache``) are installed."""
    return importlib.util.find_spec("flashinfer_jit_cache") is not None


# ------------------------------------------------------------------------------------- checks
def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def check_driver(driver: str | None, cuda: str, torch_version: str) -> Check:
    # lazy: grpo.core.device loads torch; preflight imports without it (grpo --help, the Prefect flow's process)
    from grpo.core.device import MIN_DRIVER

    need = MIN_DRIVER.get(cuda.split(".")[0])
    if driver is None:
        return Check(BLOCKER, "driver", f"no NVIDIA driver found (no /proc/driver/nvidia/version, no nvidia-smi); "
                     f"torch {torch_version} (CUDA {cuda}) needs {f'branch {need} or newer' if need else 'one'}: "
                     "install the NVIDIA driver")
    if need is None:
        return Check(WARN, "driver", f"{driver}; no minimum known for CUDA {cuda} (grpo.core.device.MIN_DRIVER): check "
                     "NVIDIA's CUDA toolkit/driver table")
    try:
        branch = int(driver.split(".")[0])
    except ValueError:
        return Check(WARN, "driver", f"{driver!r}: not a version this can read; CUDA {cuda} needs branch {need}+")
    if branch < int(need):
        return Check(BLOCKER, "driver", f"{driver} is older than torch {torch_version}'s CUDA {cuda} needs "
                     f"(branch {need} or newer): update the NVIDIA driver to {need} or newer")
    return Check(OK, "driver", f"{driver} (torch {torch_version} is CUDA {cuda}: needs branch {need} or newer)")


def check_cuda_usable(usable: bool, cuda: str, torch_version: str) -> Check:
    if usable:
        return Check(OK, "cuda", "torch.cuda.is_available()")
    return Check(BLOCKER, "cuda", f"torch {torch_version} (CUDA {cuda}) sees no usable GPU (torch.cuda.is_available() "
                 "is False): check the driver line above, CUDA_VISIBLE_DEVICES and that nvidia-smi lists the card")


def _arch(entry: str) -> tuple[str, tuple[int, int]] | None:
    """``sm_86`` -> ("sm", (8, 6)); ``compute_120`` -> ("compute", (12, 0)); ``sm_90a`` -> ("sm90a", (9, 0))."""
    found = re.fullmatch(r"(sm|compute)_(\d+)(\d)([af]?)", entry)
    if not found:
        return None
    kind, major, minor, suffix = found.groups()
    return kind + ("_" + suffix if suffix else ""), (int(major), int(minor))


def covered(capability: tuple[int, int], arch_list: list[str]) -> str | None:
    """The entry of ``arch_list`` whose code runs best on ``capability``, or None: a cubin of the
    same major version and the highest minor up to the card's (``sm_86`` on an 8.9 card rather
    than ``sm_80``; ``sm_90a`` only on 9.0), else PTX (``compute_XY``) of the newest version up to
    the card's, which the driver compiles for it."""
    cap = tuple(capability)
    cubins, ptx = [], []
    for entry in arch_list:
        parsed = _arch(entry)
        if parsed is None:
            continue
        kind, version = parsed
        if kind == "sm" and version[0] == cap[0] and version <= cap:
            cubins.append((version, 0, entry))
        elif kind.startswith("sm_") and version == cap:  # arch-specific code runs on that card only
            cubins.append((version, -1, entry))
        elif kind == "compute" and version <= cap:
            ptx.append((version, 0, entry))
    best = max(cubins) if cubins else (max(ptx) if ptx else None)
    return best[2] if best else None


def check_capability(name: str, capability: tuple[int, int], arch_list: list[str]) -> Check:
    cc = f"{capability[0]}.{capability[1]}"
    floor = f"{CAPABILITY_FLOOR[0]}.{CAPABILITY_FLOOR[1]}"
    if tuple(capability) < CAPABILITY_FLOOR:
        return Check(BLOCKER, "capability", f"{name} is compute capability {cc}, below {floor}: bitsandbytes' CUDA 13 "
                     f"library and vLLM's 4-bit kernels start at {floor} (T4 / RTX 20xx); use a newer card")
    entry = covered(capability, arch_list)
    if entry is None:
        return Check(BLOCKER, "capability", f"{name} (compute capability {cc}) is not in this torch build's "
                     f"architectures ({', '.join(arch_list) or 'none'}): install a torch build for "
                     f"sm_{capability[0]}{capability[1]}")
    if tuple(capability) < (8, 0):
        return Check(WARN, "capability", f"{name} (compute capability {cc}, torch has {entry}): fp16 compute (bf16 "
                     "needs 8.0), never run on a GPU and without loss scaling; report NaN losses")
    return Check(OK, "capability", f"{name} (compute capability {cc}, torch has {entry}): bf16")


def check_compiler(cc: str | None, environ: Mapping[str, str]) -> Check:
    if cc is None:
        if environ.get("CC"):
            return Check(BLOCKER, "compiler", f"CC={environ['CC']} is not an executable: Triton builds its kernel "
                         "launchers with $CC; point CC at gcc or clang, or unset it")
        return Check(BLOCKER, "compiler", "no C compiler (Triton builds its kernel launchers with $CC, gcc or clang at "
                     "the first kernel launch, and vLLM compiles two sampler helpers with Inductor in the training "
                     "process even with enforce_eager): install gcc (apt-get install gcc) or set CC")
    return Check(OK, "compiler", f"{cc} (Triton's launchers; vLLM's Inductor-compiled sampler helpers)")


def check_python_headers(include: Path) -> Check:
    version = f"{sys.version_info.major}.{sys.version_info.minor}"
    if not (include / "Python.h").is_file():
        return Check(BLOCKER, "python headers", f"no Python.h in {include} (Triton compiles its launchers against "
                     f"it, and Inductor vLLM's sampler helpers): install the headers of Python {version} (apt-get install python{version}-dev)")
    return Check(OK, "python headers", f"{include / 'Python.h'} (Python {sys.version.split()[0]})")


def check_memory(free: int, total: int, estimate: int | None) -> Check:
    have = f"{_gib(free)} free of {_gib(total)}"
    if estimate is None:
        return Check(OK, "gpu memory", f"{have} (no estimate to compare: --estimate-gib, from grpo check)")
    if free < estimate:
        return Check(BLOCKER, "gpu memory", f"{have} < the estimate {_gib(estimate)}: stop what else holds the card "
                     "(nvidia-smi lists it) or lower the step (grpo check --device cuda names the knob)")
    if free < 1.1 * estimate:
        return Check(WARN, "gpu memory", f"{have}, within 10% of the estimate {_gib(estimate)} (unmeasured "
                     "allowances in it): free the card of other processes if you can")
    return Check(OK, "gpu memory", f"{have} >= the estimate {_gib(estimate)}")


def flashinfer_sampler_setting(environ: Mapping[str, str]) -> str | None:
    """The user's ``VLLM_USE_FLASHINFER_SAMPLER``, or None where unset (the project's engines then set
    0). An empty value counts as set: vLLM reads any value with ``int()``."""
    return environ.get(FLASHINFER_SAMPLER_ENV)


def check_flashinfer(value: str | None, nvcc: str | None, jit_cache: bool) -> Check:
    name = "flashinfer sampler"
    if value is None:
        return Check(OK, name, f"{FLASHINFER_SAMPLER_ENV} unset: the project sets it to 0 (vLLM 0.32 would compile "
                     "FlashInfer's top-k/top-p sampler with nvcc at engine start: vllm#49497)")
    try:
        on = bool(int(value))
    except ValueError:  # vLLM's own int() of it would stop every engine at start
        return Check(BLOCKER, name, f"{FLASHINFER_SAMPLER_ENV}={value!r}: vLLM reads it with int(); set 0 or 1, "
                     "or unset it (the project then sets 0)")
    if not on:
        return Check(OK, name, f"{FLASHINFER_SAMPLER_ENV}={value} (set by you): vLLM's own top-k/top-p sampler")
    if jit_cache:
        return Check(OK, name, f"{FLASHINFER_SAMPLER_ENV}={value} (set by you): FlashInfer's sampler from its "
                     "prebuilt kernels (flashinfer-jit-cache)")
    if nvcc is not None:
        return Check(WARN, name, f"{FLASHINFER_SAMPLER_ENV}={value} (set by you): FlashInfer compiles its sampler "
                     f"with {nvcc} at the first engine start (minutes); unset it to skip that")
    return Check(BLOCKER, name, f"{FLASHINFER_SAMPLER_ENV}={value} (set by you) but no nvcc (CUDA_HOME, PATH, "
                 "/usr/local/cuda) and no flashinfer-jit-cache: FlashInfer cannot compile its sampler and every vLLM "
                 f"engine dies at start; unset {FLASHINFER_SAMPLER_ENV} (the project then sets 0)")


# ------------------------------------------------------------------------------------- the run
_READY = False
"""Whether ``require_ready_gpu`` passed in this process (it checks once)."""


def require_ready_gpu() -> None:
    """Before the pipeline's first stage (the Prefect flow calls it; ``scripts/pipeline.sh`` runs
    ``grpo doctor``): ``run_preflight``'s blockers as one ``DeviceError`` line, checked once per
    process. Nothing on a CPU build or with ``GRPO_DEVICE=cpu``. The stages themselves do not call
    it: the preflight changes no output, so it is no DVC dependency of theirs."""
    global _READY
    if not _READY:
        run_preflight().raise_for_blockers()
        _READY = True


def run_preflight(estimate_bytes: int | Callable[[int], int | None] | None = None,
                  environ: Mapping[str, str] | None = None) -> Preflight:
    """Every check of this machine for the CUDA path, in order; ``estimate_bytes``: the run's
    estimated peak GPU memory to compare free memory with, or a function of the card's total
    memory giving it (the engines' budgets are shares of the card), or None: none given. On a CPU build of
    torch, or with ``GRPO_DEVICE=cpu``, nothing is checked and the one line says so."""
    # lazy: grpo.core.device loads torch; preflight imports without it (grpo --help, the Prefect flow's process)
    from grpo.core.device import DEVICE_ENV

    environ = os.environ if environ is None else environ
    torch_version, cuda = probe_torch()
    header = f"grpo doctor: torch {torch_version}, CUDA {cuda or 'none (a CPU build)'}, Python {sys.version.split()[0]}"
    report = Preflight(header)
    add = report.checks.append
    if cuda is None:
        add(Check(SKIP, "cuda", f"no CUDA device: torch {torch_version} is a CPU build, so nothing here runs on a GPU; "
                  f"on a GPU machine this checks {WOULD_CHECK}"))
        return report
    if environ.get(DEVICE_ENV, "").strip().lower() == "cpu":
        add(Check(SKIP, "cuda", f"{DEVICE_ENV}=cpu: the pipeline runs on the CPU on purpose; unset it to check {WOULD_CHECK}"))
        return report
    add(check_driver(probe_driver(), cuda, torch_version))
    usable = probe_cuda_usable()
    add(check_cuda_usable(usable, cuda, torch_version))
    if usable:
        name, capability = probe_device()
        add(check_capability(name, capability, probe_arch_list()))
    else:
        add(Check(SKIP, "capability", "no usable GPU to ask"))
    add(check_compiler(probe_compiler(environ), environ))
    add(check_python_headers(probe_python_include()))
    if usable:
        free, total = probe_free_memory()
        add(check_memory(free, total, estimate_bytes(total) if callable(estimate_bytes) else estimate_bytes))
    else:
        add(Check(SKIP, "gpu memory", "no usable GPU to ask"))
    add(check_flashinfer(flashinfer_sampler_setting(environ), probe_nvcc(environ), probe_flashinfer_jit_cache()))
    return report
