"""How the policy reaches the train engine (its weights form), chosen once, and what each training
process runs.

A weights form (``train.rollouts.engine_weights``) is a class registered in ``WEIGHTS_FORMS`` under its
name, in its own module, which owns everything about it (``WeightsForm``'s contract below): the
engine's folder, its arguments, its start, the sync, its rule on the params and its memory. Two
are registered (``grpo.rollout.engine.forms_catalogue`` imports their modules):

- ``dense`` (``grpo.rollout.engine.dense_form.DenseForm``): the engine holds a dense copy of the base (the
  NF4 base dequantised) and each sync writes the merged ``W + s B A`` of the adapted layers into it;
- ``nf4`` (``grpo.rollout.engine.nf4_form.NF4Form``): the engine computes with the trainer's own NF4
  weights, shared, not copied, and takes the policy as a LoRA adapter loaded under a new id at each
  sync (``grpo.rollout.engine.adapter``). It needs the 4-bit base (``model.quantization: nf4``).

``choose_form`` resolves ``auto`` from the forms usable with the params, in registration order,
each with its needs: the first on a CPU, where the card is unknown, and where only one is usable;
on CUDA the first whose needs fit its budget (``gpu_memory_utilization x card``), else the
leanest. With the two above: ``dense`` where it fits, else ``nf4``. The dense engine is expected
to be the faster of the two on CUDA (one GEMM per merged layer; the ``nf4`` engine makes one
bitsandbytes call per 4-bit layer and dequantises whole layers for long prefills; not measured:
docs/gpu-notes.md#the-nf4-engine); both are exact. The estimate (``grpo.rollout.engine.needs.engine_plan``)
and the train stage (``grpo.rollout.engine.needs.form_here``) both ask this function.
``rollouts_per_process`` is the one rule of which backend each training process runs; the train
stage logs it and ``grpo check`` prints it. Nothing here imports torch or vLLM.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

from grpo.core.model_shapes import decoder_linears
from grpo.core.registry import Registry
from grpo.rollout.engine.args import engine_lora_rank

if TYPE_CHECKING:
    from pathlib import Path

    from grpo.core.model_shapes import ModelShapes
    from grpo.core.types import Lengths
    from grpo.rollout.engine.sampler import VLLMSampler


@dataclass(frozen=True)
class FormNeeds:
    """What a form's engine holds on CUDA beyond the KV cache and vLLM's own overhead (bytes), with
    the words ``grpo check`` prints for them."""

    weights: int  # the engine's own weights
    weights_how: str  # how they are counted
    lora: int = 0  # vLLM's LoRA buffers (an engine started with LoRA)
    dequant: int = 0  # a transient beside the profile run's forward
    dequant_how: str = ""  # what it is


class WeightsForm:
    """One way the train engine holds the policy; subclass, implement, register::

        @WEIGHTS_FORMS.register("name")
        class MyForm(WeightsForm): ...

    Per engine, an instance (``grpo.rollout.engine.policy_engine.policy_rollouts`` makes it with the
    engine's folder ``engine_dir`` and the compute ``dtype``, a ``torch.dtype``) is used in this
    order:

    1. ``write_folder(policy, tokenizer, base)``: write the folder the engine starts from (``base``:
       the ``ModelConfig`` of the base, or ``None`` where the folder is already there). Required.
    2. ``engine_lora(policy_rank)`` (a class method) and ``forces_eager``: the form's options of the
       engine's arguments (``grpo.rollout.engine.args.engine_args``): the LoRA rank the engine is started
       with for a policy of LoRA rank ``policy_rank`` (``None``: no LoRA support; the default), and
       whether ``enforce_eager`` is forced (default ``False``).
    3. ``start(args, tokenizer, policy, limits) -> VLLMSampler``: start the engine of ``args`` in
       this process (default: a ``VLLMSampler`` as it is, holding its calls to ``limits``, a
       ``grpo.core.types.Lengths``) and get ready to sync.
    4. ``push(sampler, policy) -> int``: bring the engine to the policy's current weights; returns
       how many layers moved. Default: through ``self.sync``, an object with ``push(sampler,
       policy)`` and ``close()`` that ``start`` makes (a form without one overrides ``push``).
    5. ``sleep(sampler)`` / ``wake_up(sampler)``: free and map back the engine's GPU memory around
       the update (``PolicyEngine`` calls them on CUDA only; default: vLLM's sleep level 1 and
       wake-up); ``close()``: release what the form holds, after the engine (default: closes
       ``self.sync`` if there is one).

    Without an engine (class methods; no torch, no vLLM):

    - ``unusable(params)``: why the form cannot serve ``params`` in a few words (``auto`` leaves it
      out and says so), or ``None`` (the default); ``check_params(params)``: raise
      ``grpo.config.reading.ParamsError`` of one line naming ``train.rollouts.engine_weights`` where ``params``
      choose this form and it cannot serve them (params validation calls it; default: nothing);
    - ``needs(shapes, lora_rank, b, dtype) -> FormNeeds``: its engine's own memory for a model of
      ``grpo.core.model_shapes.ModelShapes`` ``shapes``, a policy of LoRA rank ``lora_rank`` and ``b``
      bytes an entry (``dtype``: its name, ``bfloat16``). Required. ``grpo check`` and ``auto`` add
      the profile run, vLLM's overhead and the KV cache (``grpo.rollout.engine.needs.engine_needs``).
    """

    forces_eager: ClassVar[bool] = False
    auto_priority: ClassVar[int] = 100
    """Where ``auto`` tries this form among the usable ones: lowest first, then by name (never by
    registration or import order, which a formatter may sort)."""
    sync = None  # what ``push`` and ``close`` go through, made by ``start`` (``DenseSync``, ``AdapterSync``)

    def __init__(self, engine_dir: Path, dtype):
        self.engine_dir, self.dtype = engine_dir, dtype

    @property
    def name(self) -> str:
        """The name this form's class is registered under."""
        return form_name(type(self))

    # ------------------------------------------------------------------ the engine
    def write_folder(self, policy, tokenizer, base) -> None:
        raise NotImplementedError(f"{type(self).__name__}.write_folder")

    @classmethod
    def engine_lora(cls, policy_rank: int) -> int | None:
        return None

    def start(self, args: dict, tokenizer, policy, limits: Lengths) -> VLLMSampler:
        # lazy: the sampler loads torch; forms imports no torch (module docstring), only a started engine needs it
        from grpo.rollout.engine.sampler import VLLMSampler

        return VLLMSampler(args, tokenizer, progress=False, limits=limits)

    def push(self, sampler, policy) -> int:
        if self.sync is None:
            raise NotImplementedError(f"{type(self).__name__}: start made no sync and push is not overridden")
        return self.sync.push(sampler, policy)

    def sleep(self, sampler) -> None:
        sampler.engine().sleep(level=1)

    def wake_up(self, sampler) -> None:
        sampler.engine().wake_up()

    def close(self) -> None:
        if self.sync is not None:
            self.sync.close()

    # ------------------------------------------------------------------ the params and the memory
    @classmethod
    def unusable(cls, params) -> str | None:
        return None

    @classmethod
    def check_params(cls, params) -> None:
        """Nothing to check by default."""

    @classmethod
    def needs(cls, shapes: ModelShapes, lora_rank: int, b: int, dtype: str) -> FormNeeds:
        raise NotImplementedError(f"{cls.__name__}.needs")


WEIGHTS_FORMS: Registry[type[WeightsForm]] = Registry("train.rollouts.engine_weights", "weights form", also=("auto",))
"""The weights forms by name. Each registers itself in its module; importing
``grpo.rollout.engine.forms_catalogue`` imports them all."""


def form_name(form: type[WeightsForm]) -> str:
    """The name ``form`` is registered under (``KeyError`` if it is not)."""
    for name, entry in WEIGHTS_FORMS.items():
        if entry is form:
            return name
    raise KeyError(f"{form.__name__} is not registered in WEIGHTS_FORMS")


def lora_buffer_bytes(shapes: ModelShapes, rank: int, b: int) -> int:
    """vLLM's LoRA buffers on the device (``max_loras`` = 1), for a form whose engine is started with
    LoRA: for every decoder linear (vLLM wraps each one without ``target_modules``) an A slot
    ``r x in`` and a B slot ``out x r`` per packed slice, in the model dtype, ``r`` =
    ``grpo.rollout.engine.args.engine_lora_rank``. The adapter's own tensors are loaded into host memory
    and copied into these."""
    return engine_lora_rank(rank) * sum(x.in_features + x.out_features for x in decoder_linears(shapes)) * b


def gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def choose_form(choice: str, device: str, candidates: Sequence[tuple[str, int | None]], budget: int | None,
                utilization: float, left_out: Sequence[str] = ()) -> tuple[str, str]:
    """``train.rollouts.engine_weights`` resolved: ``(form, why)``. ``choice``: the param; ``candidates``: the
    forms usable with the params, in ``auto``'s order (``forms_catalogue.auto_order``), each with its engine's needs on CUDA
    (weights, overhead, one step's KV cache; ``None`` where not computed: only ``auto`` on CUDA
    with more than one candidate reads them); ``budget``: ``gpu_memory_utilization x card``
    (``None``: no card known); ``left_out``: why each other registered form is not usable. The
    ``why`` of a form after the first names the needs of those before it that do not fit."""
    if choice != "auto":
        return choice, "train.rollouts.engine_weights"
    first, first_need = candidates[0]
    if not device.startswith("cuda"):
        return first, f"auto: {first} on a CPU"
    if len(candidates) == 1:
        return first, f"auto: {first} ({'; '.join(left_out) or 'the only weights form'})"
    if budget is None:
        return first, (f"auto: no card given; {first} needs {gib(first_need)}, which gpu_memory_utilization "
                       f"{utilization:g} gives on cards from {gib(first_need / utilization)}")
    fits = [name for name, need in candidates if need <= budget]
    if fits and fits[0] == first:
        return first, f"auto: {first} needs {gib(first_need)} <= the budget {gib(budget)}"
    chosen = fits[0] if fits else min(candidates, key=lambda c: c[1])[0]
    names = [name for name, _ in candidates]
    over = candidates[:names.index(chosen)] if fits else [c for c in candidates if c[0] != chosen]
    return chosen, f"auto: {', '.join(f'{name} needs {gib(need)}' for name, need in over)} > the budget {gib(budget)}"


def rollouts_per_process(engine: bool, processes: int, form: str | None) -> str:
    """What each of ``processes`` training processes samples its rollouts with: a vLLM engine of
    its own holding the policy in ``form`` (``engine``: ``grpo.rollout.rollout_backends.uses_engine`` of
    ``train.rollouts.backend``), or the decode loop on the policy."""
    who = "the process" if processes == 1 else f"each of {processes} processes"
    if not engine:
        return f"{who}: the decode loop on the policy (transformers)"
    return f"{who}: a vLLM engine of its own holding the policy ({form} weights)"
