"""Device and dtype policy, in one place.

* ``default_device()``: the device every stage, bench and command computes on. ``GRPO_DEVICE``
  (``DEVICE_ENV``) chooses on purpose: ``cpu`` or ``cuda``; unset, ``cuda`` when a CUDA device is
  usable and ``cpu`` with a CPU build of torch. A CUDA build of torch that sees no usable GPU (a
  driver older than the build needs, no device visible) raises ``DeviceError``, one line naming
  the driver the build needs and ``GRPO_DEVICE=cpu``: never a silent run on the CPU.
* ``compute_dtype(setting, device)``: the training/evaluation compute dtype for a ``model.dtype``
  setting: ``auto`` is bf16 on GPUs of compute capability 8.0 or newer, fp16 on older GPUs (vLLM
  refuses bf16 there), bf16 on CPUs with native bf16 instructions (AVX512-BF16 or AMX-BF16) and
  fp32 on other CPUs (bf16 matmuls are slow without them).
* ``free_cuda_cache(device)``: give the CUDA caching allocator's unused blocks back to the driver
  before memory is handed to something outside PyTorch's allocator (a vLLM engine waking up or
  starting); nothing on CPUs.
* ``sampling_dtype(setting, device)``: ``compute_dtype``'s choice as a vLLM dtype name.
* ``attention_implementation(device)``: the transformers attention of the trained policy:
  ``eager`` on CPUs, ``sdpa`` on CUDA.
* ``refuse_half_overflow(model_dir, dtype)``: one line, before anything loads, where a model family
  is known to overflow in fp16 (``HALF_OVERFLOW``) and ``dtype`` is fp16 (pre-Ampere cards).
* ``make_deterministic()``: torch's deterministic algorithms, SDPA's math attention and cuBLAS's workspace
  (``train.deterministic``), called before the model is built.
"""

from __future__ import annotations

import gc
import json
import os
import platform
from pathlib import Path

import torch

from grpo.core.architectures import ARCHITECTURES, architecture_for_model
from grpo.core.errors import DeviceError, ModelConfigError

DEVICE_ENV = "GRPO_DEVICE"
"""Environment variable: ``cpu`` or ``cuda`` chooses the device on purpose; unset: the GPU when usable."""

MIN_DRIVER = {"11": "450", "12": "525", "13": "580"}
"""CUDA major version -> the oldest NVIDIA driver branch that runs it (minor version compatibility:
docs.nvidia.com/deploy/cuda-compatibility/minor-version-compatibility.html, table 1)."""

HALF_OVERFLOW = {"qwen2": "Qwen2 and Qwen2.5 overflow to inf/NaN in fp16 (QwenLM/Qwen3 issue 826)"}
"""``model_type`` (config.json) -> why fp16 compute is refused for it. A refusal, not fp32 norms and
residual: the overflow is in the residual stream of every layer, which both transformers and vLLM
add in the compute dtype, so a fix would patch two model implementations we do not own
(docs/gpu-notes.md#fp16-on-pre-ampere-cards)."""

TRAIN_FP32 = " with train.rollouts.backend: transformers (vLLM's LoRA kernels take fp16 and bf16 only)"
"""What fp32 training needs besides ``model.dtype: float32``: the decode loop for rollouts."""

CUBLAS_WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
"""The environment variable and value under which cuBLAS (CUDA >= 10.2) reduces in a fixed order;
torch refuses or warns at a CUDA matmul in deterministic mode without it (``:16:8`` is the other
value it accepts). Read when cuBLAS starts: it must be set before the process's first CUDA matmul."""

SDPA_FUSED = ("cudnn", "mem_efficient", "flash")
"""The fused attention backends of ``scaled_dot_product_attention`` that ``make_deterministic``
switches off (``torch.backends.cuda.enable_<kind>_sdp``)."""

BF16_CAPABILITY = (8, 0)
"""The oldest compute capability vLLM runs bf16 on, checked at engine start
(docs/gpu-notes.md#dtypes)."""


def no_usable_gpu_message(torch_version: str, cuda_version: str) -> str:
    """The one line for a CUDA build of torch that sees no usable GPU."""
    major = cuda_version.split(".")[0]
    driver = MIN_DRIVER.get(major)
    need = (f"an NVIDIA driver of branch {driver} or newer (nvidia-smi shows yours)" if driver
            else f"an NVIDIA driver that supports CUDA {cuda_version} (nvidia-smi shows yours)")
    return (f"torch {torch_version} is built for CUDA {cuda_version} but sees no usable GPU: it needs {need} "
            f"and a visible device; to run on the CPU on purpose set {DEVICE_ENV}=cpu")


def default_device() -> str:
    """``cpu`` or ``cuda``: ``GRPO_DEVICE`` when set, else ``cuda`` when usable, else ``cpu`` for a
    CPU build of torch; ``DeviceError`` (one line) for a CUDA build, or ``GRPO_DEVICE=cuda``,
    without a usable GPU."""
    want = os.environ.get(DEVICE_ENV, "").strip().lower()
    if want not in ("", "cpu", "cuda"):
        raise DeviceError(f"{DEVICE_ENV}={want!r}: must be cpu or cuda (unset: the GPU when one is usable)")
    if want == "cpu":
        return "cpu"
    if torch.cuda.is_available():
        return "cuda"
    if torch.version.cuda:
        raise DeviceError(no_usable_gpu_message(torch.__version__, torch.version.cuda))
    if want == "cuda":
        raise DeviceError(f"{DEVICE_ENV}=cuda but torch {torch.__version__} is a CPU build: install the CUDA build "
                          "(scripts/setup.sh on a machine with nvidia-smi) or unset it")
    return "cpu"


def describe_device() -> str:
    """One line naming the device this process computes on (for reports), or why there is none."""
    try:
        device = default_device()
    except DeviceError as err:
        return f"none usable: {err}"
    if device == "cuda":
        major, minor = torch.cuda.get_device_capability(0)
        return f"CUDA: {torch.cuda.get_device_name(0)} (compute capability {major}.{minor})"
    cores = len(os.sched_getaffinity(0))
    kind = f"{cpu_model()}, {'native bf16' if cpu_has_native_bf16() else 'no native bf16 (float32)'}"
    return (f"CPU: {platform.processor() or platform.machine()} ({kind}), {cores} cores, "
            f"torch threads {torch.get_num_threads()}")


def cpu_model(cpuinfo: str | Path = "/proc/cpuinfo") -> str:
    """The CPU's model name (``/proc/cpuinfo``), which with ``cpu_has_native_bf16`` says the kind of
    CPU a run's bytes belong to; "unknown model" where the file has none."""
    try:
        for line in Path(cpuinfo).read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown model"


def cuda_capability(device: str | torch.device = "cuda") -> tuple[int, int] | None:
    """The compute capability of the CUDA ``device``, or None where no GPU is usable (an estimate for
    a card this machine does not have)."""
    if not torch.cuda.is_available():
        return None
    return tuple(torch.cuda.get_device_capability(torch.device(device)))


def cuda_half_dtype(capability: tuple[int, int] | None) -> torch.dtype:
    """The 16-bit dtype for a GPU of ``capability``: bf16 from 8.0 (Ampere) on, fp16 below (vLLM
    refuses bf16 there: ``BF16_CAPABILITY``); None (no GPU to ask): bf16, the dtype of the cards
    the presets are written for."""
    if capability is None or tuple(capability) >= BF16_CAPABILITY:
        return torch.bfloat16
    return torch.float16


def compute_dtype(setting: str, device: str | torch.device, capability: tuple[int, int] | None = None) -> torch.dtype:
    """``bfloat16`` / ``float16`` / ``float32`` as named; ``auto``: on CUDA ``cuda_half_dtype`` of
    ``capability`` (default: the device's own); on CPUs bf16 where the CPU has native bf16
    instructions (``cpu_has_native_bf16``), else fp32."""
    if setting == "auto":
        if torch.device(device).type != "cuda":
            return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
        return cuda_half_dtype(capability if capability is not None else cuda_capability(device))
    return getattr(torch, setting)


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True when the CPU flags list AVX512-BF16 or AMX-BF16 (False where they cannot be read)."""
    try:
        flags = Path(cpuinfo).read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def sampling_dtype(setting: str, device: str | torch.device, capability: tuple[int, int] | None = None) -> str:
    """The sampler's dtype name: an explicit one as given; ``auto``: ``compute_dtype``'s choice."""
    if setting != "auto":
        return setting
    return str(compute_dtype("auto", device, capability)).removeprefix("torch.")


def attention_implementation(device: str | torch.device) -> str:
    """The transformers ``attn_implementation`` of the policy on ``device``: ``sdpa`` on CUDA (its
    fused kernels never hold the (N, heads, T, T) attention weights, which eager keeps for backward:
    gigabytes at seed 003's 640 tokens), ``eager`` on CPUs, where the step's attention is small and
    torch's CPU ``scaled_dot_product_attention`` with a padding mask runs slower forward and
    backward than the plain matmul-softmax-matmul (docs/lab-notebook.md, the eager-attention entry)."""
    return "sdpa" if torch.device(device).type == "cuda" else "eager"


def free_cuda_cache(device: str | torch.device) -> None:
    """On CUDA: a garbage-collection pass (tensors that only reference cycles still hold), then
    ``torch.cuda.empty_cache()``, so the blocks PyTorch keeps cached for reuse become free memory that
    a vLLM engine can map or measure; on CPUs nothing (the CPU figures never depend on it)."""
    if torch.device(device).type == "cuda":
        gc.collect()
        torch.cuda.empty_cache()


def model_type(model_dir: str | Path) -> str | None:
    """``model_type`` of a local model folder's config.json; where there is none (a hub id, a folder
    not prepared yet), that of the architecture ``grpo.core.architectures`` knows for the name
    (``deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B`` -> qwen2); else None."""
    config = Path(model_dir) / "config.json"
    if config.is_file():
        return json.loads(config.read_text()).get("model_type")
    arch = architecture_for_model(str(model_dir))
    return ARCHITECTURES[arch].get("model_type", "qwen2") if arch else None


def refuse_half_overflow(model_dir: str | Path, dtype: torch.dtype, key: str = "model.dtype") -> None:
    """Raise ``ModelConfigError`` (one line naming ``key``) when ``dtype`` is fp16 and the model in
    ``model_dir`` is of a family that overflows in fp16 (``HALF_OVERFLOW``): fp16 is what ``auto``
    gives below compute capability 8.0 (T4, V100, RTX 20xx). The way out it names: ``key`` set to
    float32 (for ``model.dtype`` the 4-bit weights stay 4-bit, and rollouts need the decode loop:
    ``TRAIN_FP32``), or a card with bf16."""
    kind = model_type(model_dir)
    if dtype == torch.float16 and kind in HALF_OVERFLOW:
        raise ModelConfigError(
            f"{key}: fp16 (this card has no bf16) refused for {model_dir} ({kind}): {HALF_OVERFLOW[kind]}; "
            f"set {key}: float32{TRAIN_FP32 if key == 'model.dtype' else ''}, or use a card of compute capability "
            "8.0 or newer (bf16)")


def make_deterministic() -> str:
    """Turn on torch's deterministic algorithms for this process, leave attention to SDPA's math
    backend, and set ``CUBLAS_WORKSPACE_CONFIG`` to ``:4096:8`` where it is unset
    (``CUBLAS_WORKSPACE``); returns the value in force. Call it before the first CUDA matmul (before
    the model is built). Ops with a deterministic variant use it (on CUDA ``scatter_add_``,
    ``index_add``, ``gather``'s backward, ...), Inductor stops autotuning, ``torch.empty`` fills its
    memory (``torch.use_deterministic_algorithms``' docstring).

    ``warn_only=True``: an op without a deterministic CUDA variant warns, naming itself, instead of
    raising, because every decode loop's sampler calls one at each token (a floating-point
    ``cumsum`` in ``grpo.rollout.sampling.sample_tokens``, on torch's list of ops that raise). Under
    ``warn_only`` torch keeps the fused attention kernels whose backward is not deterministic (cuDNN,
    memory-efficient and flash attention only warn), so they are switched off here
    (``SDPA_FUSED``): the math backend is plain matmuls and a softmax. What is left, and what the
    switch costs: docs/gpu-notes.md#what-resume-guarantees-on-each-device."""
    name, value = CUBLAS_WORKSPACE
    os.environ.setdefault(name, value)
    torch.use_deterministic_algorithms(True, warn_only=True)
    for kind in SDPA_FUSED:
        getattr(torch.backends.cuda, f"enable_{kind}_sdp")(False)
    return os.environ[name]
