"""Typed, validated parameters: one pydantic model per ``params.yaml`` section.

Contract:

* Every params file is read by ``read_params_yaml`` (``UniqueKeyLoader``): bad YAML, a key that a
  mapping repeats (PyYAML would keep the last silently) or a document that is not a mapping is a
  ``ParamsError`` of one line naming the file and line (``params.yaml:7: duplicate key 'steps'
  (first at line 3); ...``).
* ``load_params(path)`` reads the YAML and returns a ``Params`` record; an unknown key, a value of
  the wrong type or out of range fails with a ``ParamsError`` whose message is one line naming the
  field (``train.lr: must be > 0, got -1.0``; an unknown key names the nearest known ones:
  ``train.learning_rate: unknown key; did you mean train.lr?``). Building a section directly
  (``TrainConfig(lr=-1)``) fails the same way.
* The defaults below are the embedded default run and equal ``params.yaml`` key for key (a test
  enforces it), so a key left out of ``params.yaml`` or of a preset never changes the experiment
  silently. Change a default here and in ``params.yaml`` together.
* Types and ranges are declared on the fields (``Literal`` choices, ``Field(gt=0)`` bounds, strict
  types: ``"ten"`` is not an integer, ``true`` is not a number); the few rules that tie two fields
  together live in one ``_check`` method per section.
* ``reading_params()`` records which ``section.key`` fields are read while it is active (the
  stages run under it when asked, so a test can check each stage's ``params:`` in ``dvc.yaml``).
* ``overlay_params(base, overrides)`` is the one way params are put over ``params.yaml`` (a preset's
  sections, or dotted keys as the flow's ``--set`` gives them; ``grpo check --params`` and the
  tests use it in memory); ``write_params(path, overrides)`` writes its result into the file,
  comments kept, once it validates (``scripts/apply_preset.py``, ``flows/pipeline.py``).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import difflib
import io
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator


class ParamsError(ValueError):
    """Invalid parameters; the message names the offending field."""


class ModelConfigError(ValueError):
    """A model-related parameter names something that does not exist (a module, a directory)."""


class DeviceError(RuntimeError):
    """The device to compute on cannot be used (``grpo.device.default_device``); the message is one
    line saying what to do."""


class StageStop(RuntimeError):
    """A stage stops on purpose (training that keeps producing non-finite values); the message is
    one line saying where and what is left."""


Positive = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegative = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]


def Choice(param: str):  # noqa: N802 (a type)
    """A text field whose values are the names of the registry serving ``param``
    (``grpo.choices.registry``): the allowed values have that one home, and an entry registered
    anywhere is a valid value. Checked when the section is built; an unknown name is one line
    naming ``param`` and the names it takes."""

    def check(value: str) -> str:
        from grpo.choices import registry

        return registry(param).check(value, param)

    return Annotated[str, AfterValidator(check)]


Dtype = Literal["auto", "bfloat16", "float16", "float32"]

_READS: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("grpo_param_reads", default=None)


@contextlib.contextmanager
def reading_params():
    """Collect the ``section.key`` names of every params field read inside the block."""
    reads: set[str] = set()
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)


class Section(BaseModel):
    """Base of the params sections: unknown keys and loose types are errors; reads are recordable."""

    model_config = ConfigDict(extra="forbid", strict=True)
    SECTION: ClassVar[str] = ""

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as err:
            raise ParamsError(_one_line(err, self.SECTION)) from None

    def __getattribute__(self, name: str):
        reads = _READS.get()
        if reads is not None and not name.startswith("_") and name in type(self).model_fields:
            reads.add(f"{type(self).SECTION}.{name}")
        return super().__getattribute__(name)


class DataConfig(Section):
    SECTION: ClassVar[str] = "data"
    source: Literal["gsm8k", "gsm_symbolic", "arithmetic", "jsonl"] = "arithmetic"
    """``gsm8k`` (``openai/gsm8k`` from the hub; needs internet), ``gsm_symbolic`` (reasoning-gym
    GSM8K-style word problems, offline), ``arithmetic`` (``grpo.arithmetic``: flat expressions in a few
    phrasings, labels computed and checked by the project, offline) or ``jsonl`` (your own file, see ``path``)."""
    path: str = ""
    """``jsonl`` source: file with one ``{"question", "answer"}`` object a line (``id``, ``solution`` optional);
    ``test_size`` rows (seeded) become the test split, at most ``train_size`` of the rest the train split."""
    difficulty: PositiveFloat = 1.0
    """``gsm_symbolic`` difficulty (reasoning-gym's scale of number sizes)."""
    out_dir: str = "data/raw"
    """Where ``train.jsonl`` and ``test.jsonl`` are written."""
    seed: int = 0
    """Generator seed: of the problems drawn and of the hash that gives each operand set (arithmetic)
    or template (gsm_symbolic) to one split (``grpo.data.split_of``)."""
    train_size: Positive = 160
    """Training problems generated (duplicates are dropped)."""
    test_size: Positive = 500
    """Test problems: at most this many (fewer where the operand sets or templates run out)."""
    val_size: NonNegative = 200
    """Validation problems (for evaluation during training), held out like test; 0 writes an empty
    validation split."""
    min_terms: Positive = 2
    """Fewest operands per arithmetic problem."""
    max_terms: Positive = 2
    """Most operands per arithmetic problem."""
    min_digits: Positive = 1
    """Fewest digits per operand."""
    max_digits: Positive = 2
    """Most digits per operand (each operand draws its digit count, then its value)."""
    operators: list[Literal["+", "-", "*", "/"]] = Field(default_factory=lambda: ["+"])
    """Operators drawn from ``+ - * /`` (``grpo.arithmetic``: the usual precedence; ``/`` only where
    the quotient is an integer)."""

    @model_validator(mode="after")
    def _check(self):
        if self.source == "jsonl" and not self.path:
            raise ValueError("data.path: the jsonl source needs the path of your file")
        if self.min_terms > self.max_terms or self.min_digits > self.max_digits:
            raise ValueError("data.min_terms/min_digits: must not exceed max_terms/max_digits")
        return self


class ModelConfig(Section):
    SECTION: ClassVar[str] = "model"
    name: str = "smollm2-135m-instruct"
    """``smollm2-135m-instruct`` (offline default), a local directory, or a hub id."""
    path: str = "models/base"
    """Where prepare_model writes the Hugging Face directory that later stages load."""
    quantization: Literal["nf4", "none"] = "nf4"
    """``nf4``: bitsandbytes 4-bit NF4 with double quantisation; ``none``: weights in ``dtype``."""
    dtype: Dtype = "auto"
    """Compute dtype: ``bfloat16``, ``float16``, ``float32``, or ``auto`` (``grpo.device.compute_dtype``:
    bf16 on GPUs of compute capability 8.0 or newer, fp16 on older GPUs, where vLLM refuses bf16;
    bf16 on CPUs with native bf16 instructions, fp32 on other CPUs)."""
    gradient_checkpointing: bool = False
    """Recompute decoder-layer activations in backward instead of storing them."""


class LoraConfig(Section):
    SECTION: ClassVar[str] = "lora"
    rank: Positive = 16
    """LoRA rank r."""
    alpha: PositiveFloat = 32.0
    """LoRA scaling numerator: the update is ``(alpha / r) * B A x``."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the LoRA input."""
    target_modules: Annotated[list[str], Field(min_length=1)] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Leaf module names that get an adapter; each must exist in the model."""


class VLLMEngineConfig(Section):
    """Fields shared by the sections that start a vLLM engine."""

    gpu_memory_utilization: Fraction = 0.5
    """vLLM: fraction of GPU memory (on CPUs: of the NUMA node's RAM) for weights and KV cache; too
    little KV cache makes the engine preempt and recompute sequences. On a CPU the train engine's KV
    cache is one generation call's instead (``grpo.engine.bounds.train_bounds``) and the
    share is what ``grpo.engine.policy_engine.check_engine_memory`` checks for N processes."""
    max_model_len: Positive = 1024
    """vLLM: longest prompt + completion the engine accepts."""


class SentConfig(VLLMEngineConfig):
    SECTION: ClassVar[str] = "sent"
    data_path: str = "data/raw/train.jsonl"
    """Training problems to score."""
    out_path: str = "data/cache/train_sorted.jsonl"
    """The training set sorted by semantic entropy, ascending (easy -> hard)."""
    backend: Choice("sent.backend") = "auto"
    """``vllm``, ``transformers`` (the slower fallback), or ``auto`` (vLLM when installed, else transformers)."""
    num_samples: Positive = 8
    """M: answers sampled per prompt."""
    max_new_tokens: Positive = 32
    """Length cap of each sampled answer."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (SENT samples at 1.0)."""
    top_p: Fraction = 1.0
    """Nucleus sampling mass."""
    estimator: Literal["likelihood", "count"] = "likelihood"
    """``likelihood``: cluster probability from length-normalised sequence likelihoods;
    ``count``: from cluster frequencies."""
    seed: int = 0
    """Sampling seed (vLLM: the engine seed)."""
    batch_prompts: Positive = 64
    """Prompts per generation call (each yields ``num_samples`` sequences)."""
    dtype: Dtype = "auto"
    """Generation dtype: ``auto`` (``grpo.device.sampling_dtype``: on CUDA as ``model.dtype``'s
    ``auto``, bf16 on CPUs with native bf16 instructions, fp32 on other CPUs), ``bfloat16``,
    ``float16`` or ``float32``."""
    enforce_eager: bool = True
    """vLLM: skip graph capture/compilation (a much faster engine start on a CPU, same speed)."""


class EvaluateConfig(VLLMEngineConfig):
    SECTION: ClassVar[str] = "evaluate"
    test_path: str = "data/raw/test.jsonl"
    """Split to evaluate (baseline and final use the same one)."""
    backend: Choice("evaluate.backend") = "auto"
    """``vllm``, ``transformers``, or ``auto`` (vLLM when installed)."""
    max_new_tokens: Positive = 64
    """Length cap of each greedy completion."""
    batch_prompts: Positive = 64
    """Prompts per generation call."""


DEFAULT_SYSTEM_PROMPT = (
    "Solve the math problem. Think briefly, then give the final answer on its own line as '#### <number>'."
)


class TrainConfig(VLLMEngineConfig):
    SECTION: ClassVar[str] = "train"
    data_path: str = "data/cache/train_sorted.jsonl"
    """JSONL of training problems (id, question, answer); the SENT stage writes it sorted easy -> hard."""
    order: Choice("train.order") = "curriculum"
    """``curriculum``: ``num_stages`` slices of the file trained in order, shuffled within each;
    ``reversed``: the same slices hardest first (the anti-curriculum); ``shuffled``: one seeded permutation of all rows (the comparison without curriculum); ``file``: file order."""
    num_stages: Positive = 4
    """Curriculum stages; the run's steps are split evenly over them."""
    output_dir: str = "outputs/train"
    """Checkpoints and logs of the run (persisted across restarts for resume)."""
    adapter_dir: str = "models/adapter"
    """Final adapter, PEFT format."""
    metrics_dir: str = "metrics"
    """``train.json`` (summary) and ``train/`` (per-step plots data) go here; the other stages
    write their metrics here too."""
    seed: int = 0
    """Seed of sampling, shuffling and LoRA initialisation."""
    steps: Positive = 40
    """Optimizer steps."""
    prompts_per_step: Positive = 4
    """Distinct prompts per step; each gets ``group_size`` completions."""
    group_size: Annotated[int, Field(ge=2)] = 8
    """G: completions per prompt (>= 2, a group of one has no baseline)."""
    max_new_tokens: Positive = 24
    """Completion length cap."""
    rollout_backend: Choice("train.rollout_backend") = "auto"
    """Who samples the rollouts: ``vllm`` (an engine in the stage's process holding the policy,
    synced after every optimizer step: ``grpo.engine.policy_engine``; one per process with
    ``num_processes`` > 1), ``transformers`` (the project's decode loop on the policy itself, the
    fallback), or ``auto`` (vLLM when installed)."""
    max_num_batched_tokens: Positive = 2048
    """vLLM: tokens the train engine computes per iteration (a longer prefill is split over
    iterations: chunked prefill). At start the engine runs one forward pass of this many tokens
    to size its activation memory, which it keeps beside the weights and KV cache, so this bounds
    the engine's overhead. Raised to the step's completions per generation call where below it
    (vLLM needs a token per running sequence) and capped at those completions x ``max_model_len``
    (``grpo.engine.bounds.step_limits``); the engine's ``max_num_seqs`` is those completions."""
    engine_weights: Choice("train.engine_weights") = "auto"
    """How the train engine holds the policy, a weights form (``grpo.engine.forms.WEIGHTS_FORMS``):
    ``dense`` (its own copy of the base, the 4-bit base dequantised to the compute dtype, the
    policy's adapter merged into the adapted layers each step: ``grpo.engine.dense_form``), ``nf4``
    (no copy: the trainer's own 4-bit layers, embedding and head computed through a vLLM
    quantization method of ours, the policy's adapter sent as a LoRA adapter each step:
    ``grpo.engine.nf4_form``; needs ``model.quantization: nf4``) or ``auto``
    (``grpo.engine.forms.choose_form``: dense where its weights, overhead and the KV cache of one
    step fit ``gpu_memory_utilization`` of the card, else nf4; dense on CPUs). ``grpo check
    --device cuda --gpu-memory GIB`` shows the arithmetic; the chosen form is logged and written to
    ``metrics/train.json``."""
    importance_sampling_correction: bool = True
    """With engine rollouts, weight each token's policy-gradient term by the truncated ratio
    ``min(pi_trainer / pi_engine, importance_sampling_cap)`` of the sampled token's probabilities
    (truncated importance sampling, as TRL's ``vllm_importance_sampling_correction``)."""
    importance_sampling_cap: PositiveFloat = 2.0
    """Upper bound of that ratio."""
    temperature: PositiveFloat = 0.7
    """Sampling temperature of rollouts."""
    top_p: Fraction = 1.0
    """Nucleus sampling mass of rollouts."""
    mu: Positive = 2
    """Policy updates per batch of rollouts (against fixed old log-probs)."""
    micro_batches: Positive = 1
    """Gradient accumulation: the step's completions are split into this many forward/backward
    chunks. The update is the same for any value (the entropy threshold and the loss normaliser
    are taken over the whole step); only memory and time change."""
    generation_batch_size: NonNegative = 0
    """Completions per ``generate`` call (a group may span two calls); 0 generates the whole step at
    once. Smaller calls hold a smaller KV cache; on a GPU they are slower."""
    shared_prompt_forward: bool = True
    """The training and log-prob passes run each group's prompt once and its G completions on the
    shared KV cache (``grpo.logprobs.completion_hidden``); off: every row runs its own prompt.
    Nothing is shared under gradient checkpointing. (Generation always prefills a prompt once.)"""
    forward_layout: Literal["auto", "padded", "packed"] = "auto"
    """How those passes lay out a group with ``shared_prompt_forward``: ``padded`` runs its G
    completions as G rows padded to the longest completion of the micro-batch, on the prompt's KV
    cache; ``packed`` runs the prompt and the G completions back to back as one sequence, a block
    mask keeping each completion to the prompt and itself (``grpo.logprobs.packed_hidden``): no
    compute on padding, attention over the group's whole length; ``auto``: packed except on CUDA
    (where the padding costs little and the longer attention costs memory). The same update up to
    float reassociation."""
    release_generation_memory: bool = True
    """After the rollouts, collect garbage and return the CUDA cache's free blocks before the
    training forward (lowers peak *reserved* memory; no effect on the CPU)."""
    lr: PositiveFloat = 3e-4
    """AdamW peak learning rate (LoRA parameters only)."""
    weight_decay: Annotated[float, Field(ge=0)] = 0.0
    """AdamW weight decay."""
    warmup_steps: NonNegative = 2
    """Linear warm-up steps."""
    lr_schedule: Literal["constant", "linear", "cosine"] = "cosine"
    """After warm-up: ``constant``, ``linear`` or ``cosine`` decay to zero."""
    max_grad_norm: PositiveFloat = 1.0
    """Clip the global gradient norm to this value."""
    epsilon: PositiveFloat = 0.2
    """Lower clip of the ratio: ``1 - epsilon``."""
    epsilon_high: PositiveFloat | None = None
    """Upper clip ``1 + epsilon_high`` (DAPO clip-higher); ``null`` means ``epsilon``."""
    beta: Annotated[float, Field(ge=0)] = 0.0
    """k3 KL coefficient; 0 skips the reference forward pass entirely, and the update leaves out the
    groups whose rewards are all equal (their gradient is zero then: ``GRPOTrainer.update_rows``)."""
    loss_type: Choice("train.loss_type") = "dapo"
    """How the token terms become the loss (``grpo.loss.AGGREGATIONS``): ``grpo`` (per-sequence
    mean), ``dr_grpo`` (sum / max length), ``dapo`` (token mean over batch)."""
    policy_loss: Choice("train.policy_loss") = "clipped"
    """The per-token policy-gradient term (``grpo.loss.POLICY_LOSSES``): ``clipped``, PPO's clipped
    surrogate ``-min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A)``."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """``group``, ``batch`` or ``none``: what the centred rewards are divided by."""
    entropy_top_quantile: Fraction = 0.2
    """The fraction q of the step's valid completion tokens, by highest entropy, that the rule counts as
    high-entropy: under ``sent_kl`` the others carry the KL, under ``high`` only these get gradient;
    1.0: every token, no entropy treatment."""
    entropy_rule: Choice("train.entropy_rule") = "archer"
    """The token-entropy rule (``grpo.entropy.TOKEN_RULES``), how tokens are treated by their
    entropy: ``archer`` (the default, with ``mu`` 2: chosen by the decision rule of docs/results.md), see below; ``sent_kl``, see below;
    ``high``, only the top ``entropy_top_quantile`` get gradient (arXiv 2506.01939); ``low``, only
    every other valid token (the bottom ``1 - entropy_top_quantile``: the masking paper's contrast,
    for ablations); ``archer``, every token, the top ``entropy_top_quantile`` of each response
    clipped at ``entropy_clip_high``, the others with the ``entropy_kl_low`` KL (Archer);
    ``sent_kl``, every token, those below the step's threshold with the ``entropy_kl_low`` KL (after
    SENT; at ``entropy_top_quantile`` 1 no KL: every token, as ``high`` at 1). ``low`` and ``archer`` need
    ``entropy_top_quantile`` below 1."""
    entropy_clip_high: PositiveFloat = 0.5
    """``entropy_rule: archer``: the clip range of the high-entropy tokens, ``1 - x`` to ``1 + x``
    (Archer's 0.5; its low-entropy tokens clip at ``epsilon`` / ``epsilon_high``). Other rules ignore it."""
    entropy_kl_low: Annotated[float, Field(ge=0)] = 0.001
    """``entropy_rule: archer`` or ``sent_kl``: the coefficient of the k3 KL to the reference policy on
    the low-entropy tokens (Archer's 0.001), which needs the reference pass even at ``beta`` 0 (0:
    no KL, no pass). Other rules ignore it."""
    kernel: Literal["auto", "triton", "torch"] = "auto"
    """Entropy/log-prob pass: ``triton`` (CUDA), ``torch``, or ``auto`` (triton when on CUDA)."""
    logprob_chunk: Positive = 1024
    """Rows (token positions) per chunk of the no-grad entropy/log-prob pass."""
    checkpoint_every: NonNegative = 10
    """Write a resumable checkpoint every N steps (0: never)."""
    val_path: str = "data/raw/val.jsonl"
    """Validation problems for the evaluation during training (``prepare_data`` writes them)."""
    eval_every: NonNegative = 10
    """Greedy accuracy on ``val_path`` every N steps and after the last one, with the rollout
    backend (0: never)."""
    eval_max_new_tokens: Positive = 64
    """Length cap of the validation completions."""
    max_logp_gap: PositiveFloat = 0.1
    """Bound on the mean |engine log-prob - policy log-prob| per completion token of a step
    (``logp_mismatch_mean``, measured where the engine returns log-probs): above it the step logs a
    warning (an engine that samples from another model than the one trained: a broken sync, an
    adapter lost in a wake-up); ``max_logp_gap_steps`` such steps in a row stop the stage."""
    max_logp_gap_steps: Positive = 3
    """Steps in a row above ``max_logp_gap`` before the stage stops with one line."""
    max_nonfinite_steps: Positive = 3
    """A step whose loss, log-probs or gradient norm is not finite applies no update (parameters and
    optimizer state unchanged; logged and counted as ``update_skipped``); this many such steps in a
    row stop the stage with one line naming the step and the last checkpoint."""
    keep_best: bool = True
    """Write the adapter of the best validation accuracy (earliest on ties) as the stage's adapter
    instead of the last one; ``models/adapter/selection.json`` says which was written."""
    rewards: dict[Choice("train.rewards"), float] = Field(default_factory=lambda: {"correctness": 1.0})
    """Reward function name -> weight; the total reward is the weighted sum."""
    truncated: Literal["zero", "score"] = "zero"
    """A completion that ``max_new_tokens`` cut off (no EOS): ``zero`` gives it reward 0 from every
    reward function (it never stated its final answer; the last number of a cut-off text is
    usually an intermediate one), ``score`` scores its text like any other."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """System message (chat template) or preamble (plain template) of every prompt."""
    wandb_mode: Literal["online", "offline", "disabled"] = "offline"
    """wandb: ``online``, ``offline`` or ``disabled``."""
    wandb_project: str = "grpo"
    """wandb project name."""
    num_processes: Positive = 1
    """Data-parallel training processes on this machine (``grpo.distributed``): the stage launches
    them itself through torch.distributed's launcher, each with ``prompts_per_step /
    num_processes`` whole groups; the update equals one process's. gloo on CPUs, NCCL on GPUs
    (one GPU each). With engine rollouts each process holds its own engine: on a CPU that is
    ``num_processes`` shares of ``gpu_memory_utilization`` of the RAM (checked before launching)."""
    dist_timeout_s: PositiveFloat = 600.0
    """With several processes, from the first training step on: a collective that waits longer
    than this for another rank fails and takes the stage down (a rank that hangs, or a rank of
    another machine that is gone). Start-up (loading, an engine's start, resuming) is bounded by
    ``grpo.distributed.STARTUP_TIMEOUT_S`` instead: ranks reach the first step at different times."""
    deepspeed_config: str = ""
    """A DeepSpeed JSON (e.g. ``configs/accelerate/ds_zero2_offload.json``: ZeRO-2, AdamW state
    offloaded to CPU memory): the LoRA update runs through a DeepSpeed engine (``grpo.zero``) instead
    of the trainer's AdamW, gradient all-reduce and clipping. The JSON sets the ZeRO stage (1 or 2),
    offload and precision; lr, weight decay, clipping and accumulation stay these params'. Resume
    restarts AdamW's moments (the partitioned state is not checkpointed). Empty: no DeepSpeed."""

    @model_validator(mode="after")
    def _check(self):
        if not self.rewards:
            raise ValueError("train.rewards: name at least one reward function")
        from grpo.choices import registry

        registry("train.entropy_rule")[self.entropy_rule].check(self)
        self.check_split(self.num_processes, "train.num_processes")
        return self

    def check_split(self, processes: int, source: str = "the launcher's WORLD_SIZE") -> None:
        """Raise unless ``prompts_per_step`` splits evenly over ``processes`` (whole groups per
        process); ``source`` names where the process count comes from."""
        if self.prompts_per_step % processes:
            raise ParamsError(f"train.prompts_per_step: {self.prompts_per_step} prompts do not split evenly over "
                              f"{processes} processes ({source}; whole groups per process)")


class Params(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    sent: SentConfig = Field(default_factory=SentConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)

    def check_across_sections(self) -> Params:
        """The rules that tie two sections together; ``ParamsError`` naming the key. The chosen weights
        form's own rule (``WeightsForm.check_params``: nf4 needs ``model.quantization: nf4``)."""
        from grpo.choices import registry

        forms = registry("train.engine_weights")
        if self.train.engine_weights in forms:  # not auto
            forms[self.train.engine_weights].check_params(self)
        return self


SECTIONS: dict[str, type[Section]] = {
    name: field.default_factory for name, field in Params.model_fields.items()  # type: ignore[misc]
}


def _describe(err: dict) -> str:
    """One error of a pydantic ``ValidationError`` in this project's words."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "literal_error":
        return f"must be one of {ctx['expected'].replace(' or ', ', ').replace(chr(39), '')}; got {value!r}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        limit = int(limit) if isinstance(limit, float) and limit.is_integer() else limit
        return f"must be {bounds[kind]} {limit}, got {value!r}"
    words = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "list_type": "a list", "dict_type": "a mapping", "model_type": "a mapping",
             "too_short": "non-empty"}
    if kind in words:
        return f"must be {words[kind]}, got {value!r}{_number_as_text_hint(kind, value)}"
    return f"{err['msg'][0].lower()}{err['msg'][1:]}, got {value!r}"


_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _number_as_text_hint(kind: str, value: Any) -> str:
    """For a number that reached a numeric field as text, how to write it; else nothing (a word
    like ``"fast"`` gets no hint: the message says what type the field takes)."""
    if not isinstance(value, str) or kind not in ("float_type", "int_type"):
        return ""
    text = value.strip()
    if kind == "int_type":
        return f" (quoted: write {text} without quotes)" if re.fullmatch(r"[+-]?\d+", text) else ""
    if not _DECIMAL.fullmatch(text):
        return ""
    mantissa, e, exponent = text.lower().partition("e")
    if e and "." not in mantissa:  # 5e-4: YAML 1.1 (PyYAML, the stages) needs a dot in the mantissa
        return f" (YAML reads {text} as text: write {mantissa}.0e{exponent})"
    return f" (quoted: write {text} without quotes)"


ALIASES: dict[str, str] = {
    # TRL's GRPOConfig / transformers' TrainingArguments names -> this project's train keys
    "learning_rate": "lr", "num_generations": "group_size", "max_completion_length": "max_new_tokens",
    "max_steps": "steps", "num_iterations": "mu", "gradient_accumulation_steps": "micro_batches",
    "lr_scheduler_type": "lr_schedule", "scale_rewards": "advantage_scale", "reward_weights": "rewards",
    "top_entropy_quantile": "entropy_top_quantile", "save_steps": "checkpoint_every", "eval_steps": "eval_every",
    "use_vllm": "rollout_backend", "vllm_gpu_memory_utilization": "gpu_memory_utilization",
    "vllm_importance_sampling_correction": "importance_sampling_correction",
    "vllm_importance_sampling_cap": "importance_sampling_cap", "kl_coef": "beta", "cliprange": "epsilon",
    "per_device_train_batch_size": "prompts_per_step", "epsilon_low": "epsilon",
    # peft's LoraConfig names -> the lora keys
    "r": "rank", "lora_r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
    # the model
    "torch_dtype": "dtype", "model_name": "name", "model_name_or_path": "name", "load_in_4bit": "quantization",
}
"""Keys people bring from other tools -> the nearest key here (suggested where the section has it)."""


def suggest(name: str, known: list[str] | set[str] | tuple[str, ...], n: int = 3) -> list[str]:
    """The known names nearest to ``name``: its alias (``ALIASES``), then the closest spellings."""
    out = [ALIASES[name]] if ALIASES.get(name) in known else []
    out += [k for k in difflib.get_close_matches(name, sorted(known), n=n, cutoff=0.6) if k not in out]
    return out[:n]


def _did_you_mean(prefix: str, names: list[str]) -> str:
    names = [f"{prefix}{n}" for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _one_line(err: ValidationError, section: str) -> str:
    """The first error of ``err`` as ``section.key: what is wrong`` (one line)."""
    first = err.errors(include_url=False)[0]
    if first["type"] == "value_error":  # a cross-field rule: its message already names the field
        return _describe(first)
    loc = ".".join(str(p) for p in (section, *first["loc"]) if p != "")
    message = f"{loc}: {_describe(first)}"
    if first["type"] == "extra_forbidden":
        cls = SECTIONS.get(section)
        key = str(first["loc"][-1]) if first["loc"] else ""
        if cls is not None:
            near = suggest(key, set(cls.model_fields))
            message += (f"; did you mean {_did_you_mean(f'{section}.', near)}?" if near else
                        f"; {section} has no key like it ({len(cls.model_fields)} keys: docs/configuration.md)")
    return message.replace("\n", " ")


def params_from_dict(raw: dict | None) -> Params:
    """Validated ``Params`` from a plain mapping (sections or keys left out take the defaults)."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ParamsError(f"params: must be a mapping of sections, got {raw!r}")
    for key in raw:
        if key not in SECTIONS:
            near = suggest(str(key), set(SECTIONS))
            guess = f"did you mean {_did_you_mean('', near)}? " if near else ""
            raise ParamsError(f"{key}: unknown params section; {guess}(sections: {', '.join(sorted(SECTIONS))})")
    sections = {}
    for name, values in raw.items():
        if not isinstance(values, dict):
            raise ParamsError(f"{name}: must be a mapping, got {values!r}")
        sections[name] = SECTIONS[name](**values)
    return Params(**sections).check_across_sections()


def overlay_params(base: dict, overrides: dict | None) -> dict:
    """A copy of ``base`` (a params mapping: sections of keys) with ``overrides`` put over it; ``base``
    is left as it was (a ruamel document's comments and order are copied along).

    An override is a section with any subset of its keys (a preset: ``{"train": {"lr": 5e-4}}``) or a
    dotted key of any depth (``{"train.lr": 5e-4}``, as ``dvc exp run -S`` and the flow's ``--set``
    write them). Either way each key named gets the new value whole (a preset's ``rewards`` is the
    run's rewards, not a merge). A section left empty in ``base`` (``train:``) counts as one with no
    keys; a section or key missing from ``base`` is added, and an unknown one is left for validation
    to name. The one error here: the way to a key passes through a value that is not a mapping
    (``ParamsError`` naming the key)."""
    out = copy.deepcopy(base) if base is not None else {}
    for section in list(out):
        if out[section] is None:
            out[section] = {}
    for key, value in (overrides or {}).items():
        parts = str(key).split(".")
        if len(parts) == 1:  # a section and some of its keys
            if not isinstance(value, dict):
                raise ParamsError(f"{key}: must be a mapping, got {value!r}")
            parts, items = [key], value.items()
        else:
            parts, items = parts[:-1], [(parts[-1], value)]
        node = out
        for i, part in enumerate(parts):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                where = ".".join(parts[:i + 1])
                raise ParamsError(f"{where}: must be a mapping, got {node!r}" + (f" (to set {key})" if where != key else ""))
        for name, new in items:
            node[name] = new
    return out


def _float_yaml11(representer, value: float):
    """A float that YAML 1.1 readers (PyYAML: the stages, ``load_params``) also read as a number:
    ``5.0e-06``, not ruamel's ``5e-06``, which they read as text."""
    text = repr(value)
    if "e" in text and "." not in text.split("e")[0]:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return representer.represent_scalar("tag:yaml.org,2002:float", text)


def write_params(path: str | Path, overrides: dict | None) -> Params:
    """Put ``overrides`` over the params file ``path`` (``overlay_params``) and write it back, its
    comments and key order kept, so it stays complete as ``dvc.yaml``'s ``params:`` need; the result,
    read back as the stages read it, is validated first and returned. A missing or unreadable file or
    a bad result writes nothing and raises ``ParamsError``: one line naming the file or the field."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    path = Path(path)
    read_params_yaml(path)  # its one-line errors (ruamel's would span lines); ruamel also refuses repeated keys
    rt = YAML()
    rt.representer.add_representer(float, _float_yaml11)
    try:
        doc = rt.load(path.read_text())
    except YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if doc is not None and not isinstance(doc, dict):
        raise ParamsError(f"{path}: must be a mapping of sections, got {doc!r}")
    out = io.StringIO()
    rt.dump(overlay_params(doc, overrides), out)
    params = params_from_dict(yaml.safe_load(out.getvalue()))
    path.write_text(out.getvalue())
    return params


class DuplicateKey(yaml.MarkedYAMLError):
    """A YAML mapping names one key twice (``key``; ``first``, ``again``: 1-based line numbers)."""

    def __init__(self, key, first: int, again: yaml.Mark):
        super().__init__(problem=f"duplicate key {key!r}", problem_mark=again)
        self.key, self.first, self.again = key, first, again.line + 1


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping that repeats a key raises ``DuplicateKey``
    (PyYAML keeps the last value silently). Merge keys (``<<``) are not repeats."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise DuplicateKey(key, seen[key], key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def yaml_error_line(path: Path, err: yaml.YAMLError) -> str:
    """One line for a YAML file PyYAML refuses: ``FILE:LINE: what``, where it can tell the line."""
    if isinstance(err, DuplicateKey):
        return (f"{path}:{err.again}: duplicate key {err.key!r} (first at line {err.first}); a mapping takes each "
                "key once")
    mark = getattr(err, "problem_mark", None)
    what = " ".join(": ".join(x for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x).split())
    if mark is None:
        return f"{path}: not valid YAML ({' '.join(str(err).split())})"
    return f"{path}:{mark.line + 1}: not valid YAML ({what or 'unreadable'}, column {mark.column + 1})"


def read_params_yaml(path: str | Path) -> dict:
    """The mapping in the params file ``path`` (``{}`` when empty), read by ``UniqueKeyLoader``: every
    reader of params goes through here. A missing file, a YAML error, a repeated key or a
    document that is not a mapping raises ``ParamsError``, one line naming the file (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found")
    try:
        raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        raise ParamsError(yaml_error_line(path, err)) from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of sections, got {raw!r}")
    return raw or {}


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read (``read_params_yaml``) and validate ``params.yaml``."""
    return params_from_dict(read_params_yaml(path))
