"""How the policy reaches the train engine, chosen once, and what each training process runs.

Two weights forms (``train.engine_weights``):

- ``dense``: the engine holds a dense copy of the base (the NF4 base dequantised) and each sync
  writes the merged ``W + s B A`` of the adapted layers into it (``grpo.engine.dense_form``);
- ``nf4``: the engine computes with the trainer's own NF4 weights, shared, not copied, and takes
  the policy as a LoRA adapter loaded under a new id at each sync (``grpo.engine.nf4_form``,
  ``grpo.engine.adapter``). It needs the 4-bit base (``model.quantization: nf4``).

``choose_form`` resolves ``auto``: ``dense`` where the dense engine's needs fit its budget
(``gpu_memory_utilization x card``), else ``nf4``; ``dense`` on a CPU, where the card is unknown
and where the base is not 4-bit. The dense engine is expected to be the faster of the two on CUDA
(one GEMM per merged layer; the ``nf4`` engine makes one bitsandbytes call per 4-bit layer and
dequantises whole layers for long prefills; not measured: docs/gpu-notes.md#the-nf4-engine); both
are exact. The estimate (``grpo.memory.engine_plan``) and
the train stage (``grpo.memory.form_here``) both compute the dense engine's needs and ask this
function. ``rollouts_per_process`` is the one rule of which backend each training process runs;
the train stage logs it and ``grpo check`` prints it. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

FORMS = ("dense", "nf4")


def check_form(form: str) -> str:
    """``form`` if it is one of ``FORMS``, else ``ValueError`` naming the param (``auto`` is
    resolved by ``choose_form`` before an engine is built)."""
    if form not in FORMS:
        raise ValueError(f"engine_weights: must be one of {', '.join(FORMS)} (the caller resolves auto); got {form!r}")
    return form


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def choose_form(choice: str, device: str, dense_need: int | None, budget: int | None,
                utilization: float, nf4_base: bool = True) -> tuple[str, str]:
    """``train.engine_weights`` resolved: ``(dense | nf4, why)``. ``choice``: the param;
    ``dense_need``: the dense engine's bytes (weights, overhead, one step's KV cache) on CUDA;
    ``budget``: ``gpu_memory_utilization x card`` (``None``: no card known); ``nf4_base``: the
    policy's base is 4-bit (``model.quantization: nf4``)."""
    if choice != "auto":
        return choice, "train.engine_weights"
    if not device.startswith("cuda"):
        return "dense", "auto: dense on a CPU"
    if not nf4_base:
        return "dense", "auto: dense (model.quantization none: no 4-bit base to share)"
    if budget is None:
        return "dense", (f"auto: no card given; dense needs {gib(dense_need)}, which "
                         f"gpu_memory_utilization {utilization:g} gives on cards from {gib(dense_need / utilization)}")
    fits = dense_need <= budget
    return ("dense" if fits else "nf4"), f"auto: dense needs {gib(dense_need)} {'<=' if fits else '>'} the budget {gib(budget)}"


def rollouts_per_process(engine: bool, processes: int, form: str | None) -> str:
    """What each of ``processes`` training processes samples its rollouts with: a vLLM engine of
    its own holding the policy in ``form`` (``engine``: ``grpo.rollout_backends.uses_engine`` of
    ``train.rollout_backend``), or the decode loop on the policy."""
    who = "the process" if processes == 1 else f"each of {processes} processes"
    if not engine:
        return f"{who}: the decode loop on the policy (transformers)"
    return f"{who}: a vLLM engine of its own holding the policy ({form} weights)"
