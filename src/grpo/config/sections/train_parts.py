"""The parts of the ``train`` section, each a typed model of its own (``train.rollouts``,
``train.optimizer``, ``train.loss``, ``train.passes``, ``train.guards``, ``train.checkpoints``,
``train.distribution``, ``train.wandb``); ``grpo.config.sections.train.TrainConfig`` holds one of each
beside the run's own keys. A registered entry's options sit under its name in its part
(``train.loss.entropy_rule_options.archer.clip_high``, ``train.loss.policy_loss_options.clipped.epsilon``)."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from grpo.config.choices import Choice, EntryOptions, entry_defaults, registry
from grpo.config.sections.engine import VLLMEngineConfig
from grpo.core.fields import Fraction, NonNegative, Positive, PositiveFloat, Section

_PARTS = {
    "rollouts": ("prompts_per_step", "group_size", "max_new_tokens", "temperature", "top_p", "generation_batch_size",
                 "release_generation_memory", "gpu_memory_utilization", "max_model_len", "max_num_batched_tokens",
                 "engine_weights"),
    "optimizer": ("lr", "weight_decay", "warmup_steps", "lr_schedule", "max_grad_norm", "mu"),
    "loss": ("loss_type", "policy_loss", "beta", "advantage_scale", "entropy_rule"),
    "passes": ("micro_batches", "shared_prompt_forward", "forward_layout", "kernel", "logprob_chunk"),
    "guards": ("max_logp_gap", "max_logp_gap_steps", "max_nonfinite_steps"),
    "checkpoints": ("val_path", "eval_every", "eval_max_new_tokens", "keep_best"),
    "distribution": ("num_processes", "dist_timeout_s", "deepspeed_config"),
}
MOVED: dict[str, str] = {
    **{key: f"train.{part}.{key}" for part, keys in _PARTS.items() for key in keys},
    "rollout_backend": "train.rollouts.backend",
    "importance_sampling_cap": "train.rollouts.importance_sampling_cap",
    "importance_sampling_correction": "train.rollouts.importance_sampling_cap (null: no correction)",
    "epsilon": "train.loss.policy_loss_options.clipped.epsilon",
    "epsilon_high": "train.loss.policy_loss_options.clipped.epsilon_high",
    "entropy_top_quantile": "train.loss.entropy_rule_options.<rule>.top_quantile (each rule's own)",
    "entropy_rule_options": "train.loss.entropy_rule_options",
    "checkpoint_every": "train.checkpoints.every",
    "wandb_mode": "train.wandb.mode",
    "wandb_project": "train.wandb.project",
    "num_stages": "train.order_options.curriculum.num_stages (and .reversed.num_stages)",
    "entropy_clip_high": "train.loss.entropy_rule_options.archer.clip_high",
    "entropy_kl_low": "train.loss.entropy_rule_options.sent_kl.kl_low (and .archer.kl_low)",
}
"""Every key the train section had at its top level once -> where it lives now (one line each)."""


class TrainPart(Section):
    """A part of the train section: an unknown key in it is answered from ``MOVED`` too
    (``train.loss.epsilon: moved to train.loss.policy_loss_options.clipped.epsilon``)."""

    MOVED: ClassVar[dict[str, str]] = MOVED


class RolloutsConfig(VLLMEngineConfig, TrainPart):
    SECTION: ClassVar[str] = "train.rollouts"
    prompts_per_step: Positive = 4
    """Distinct prompts per step; each gets ``group_size`` completions."""
    group_size: Annotated[int, Field(ge=2)] = 8
    """G: completions per prompt (>= 2, a group of one has no baseline)."""
    max_new_tokens: Positive = 24
    """Completion length cap."""
    temperature: PositiveFloat = 0.7
    """Sampling temperature of rollouts."""
    top_p: Fraction = 1.0
    """Nucleus sampling mass of rollouts."""
    backend: Choice("train.rollouts.backend") = "auto"
    """Who samples the rollouts: ``vllm`` (an engine in the stage's process holding the policy,
    synced after every optimizer step: ``grpo.rollout.engine.policy_engine``; one per process with
    ``train.distribution.num_processes`` > 1), ``transformers`` (the project's decode loop on the
    policy itself, the fallback), or ``auto`` (vLLM when installed)."""
    generation_batch_size: NonNegative = 0
    """Completions per ``generate`` call (a group may span two calls); 0 generates the whole step at
    once. Smaller calls hold a smaller KV cache; on a GPU they are slower."""
    release_generation_memory: bool = True
    """After the rollouts, collect garbage and return the CUDA cache's free blocks before the
    training forward (lowers peak *reserved* memory; no effect on the CPU)."""
    max_num_batched_tokens: Positive = 2048
    """vLLM: tokens the train engine computes per iteration (a longer prefill is split over
    iterations: chunked prefill). At start the engine runs one forward pass of this many tokens
    to size its activation memory, which it keeps beside the weights and KV cache, so this bounds
    the engine's overhead. Raised to the step's completions per generation call where below it
    (vLLM needs a token per running sequence) and capped at those completions x ``max_model_len``
    (``grpo.rollout.engine.bounds.step_limits``); the engine's ``max_num_seqs`` is those completions."""
    engine_weights: Choice("train.rollouts.engine_weights") = "auto"
    """How the train engine holds the policy, a weights form (``grpo.rollout.engine.forms.WEIGHTS_FORMS``):
    ``dense`` (its own copy of the base, the 4-bit base dequantised to the compute dtype, the
    policy's adapter merged into the adapted layers each step: ``grpo.rollout.engine.dense_form``), ``nf4``
    (no copy: the trainer's own 4-bit layers, embedding and head computed through a vLLM
    quantization method of ours, the policy's adapter sent as a LoRA adapter each step:
    ``grpo.rollout.engine.nf4_form``; needs ``model.quantization: nf4``) or ``auto``
    (``grpo.rollout.engine.forms.choose_form``: dense where its weights, overhead and the KV cache of one
    step fit ``gpu_memory_utilization`` of the card, else nf4; dense on CPUs). ``grpo check
    --device cuda --gpu-memory GIB`` shows the arithmetic; the chosen form is logged and written to
    ``metrics/train.json``."""
    importance_sampling_cap: PositiveFloat | None = 2.0
    """With engine rollouts, weight each token's policy-gradient term by the truncated ratio
    ``min(pi_trainer / pi_engine, cap)`` of the sampled token's probabilities (truncated importance
    sampling, as TRL's ``vllm_importance_sampling_correction`` / ``_cap``); ``null``: no correction."""


class OptimizerConfig(TrainPart):
    SECTION: ClassVar[str] = "train.optimizer"
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
    mu: Positive = 1
    """Policy updates per batch of rollouts (against fixed old log-probs; at 1 the ratio is 1 and
    PPO's clip never binds)."""
    equal_reward_groups: Literal["auto", "keep", "drop"] = "drop"
    """The rows of the groups whose completions all earned the same reward (zero advantage, so no
    policy gradient): ``keep`` them in the update, ``drop`` them (DAPO's filter, without its
    re-sampling; a KL term then acts on the other rows only), or ``auto``: kept where the loss has a
    KL term (``train.loss.beta`` > 0 or the token-entropy rule's own), whose gradient they carry,
    dropped otherwise (``grpo.training.trainer.GRPOTrainer.update_rows``)."""


class LossConfig(TrainPart):
    SECTION: ClassVar[str] = "train.loss"
    loss_type: Choice("train.loss.loss_type") = "dapo"
    """How the token terms become the loss (``grpo.algorithm.loss.AGGREGATIONS``): ``grpo`` (per-sequence
    mean), ``dr_grpo`` (sum / max length), ``dapo`` (token mean over batch)."""
    policy_loss: Choice("train.loss.policy_loss") = "clipped"
    """The per-token policy-gradient term (``grpo.algorithm.loss.POLICY_LOSSES``): ``clipped``, PPO's clipped
    surrogate ``-min(rho * A, clip(rho, 1 - epsilon, 1 + epsilon_high) * A)``."""
    policy_loss_options: EntryOptions("train.loss.policy_loss") = Field(
        default_factory=entry_defaults("train.loss.policy_loss"))
    """Each policy term's own options under its name (``clipped``'s ``epsilon`` and ``epsilon_high``)."""
    beta: Annotated[float, Field(ge=0)] = 0.0
    """k3 KL coefficient; 0 skips the reference forward pass entirely, and the update leaves out the
    groups whose rewards are all equal (their gradient is zero then: ``GRPOTrainer.update_rows``)."""
    advantage_scale: Literal["group", "batch", "none"] = "group"
    """``group``, ``batch`` or ``none``: what the centred rewards are divided by."""
    entropy_rule: Choice("train.loss.entropy_rule") = "high"
    """The token-entropy rule (``grpo.algorithm.entropy.TOKEN_RULES``), how tokens are treated by their
    entropy (the default ``high`` at ``top_quantile`` 1.0, every token, with ``train.optimizer.mu`` 1:
    the cost grid's decision rule chose it, docs/results.md): ``high``, only the top ``top_quantile``
    get gradient (arXiv 2506.01939 at 0.2; ``top_quantile`` 1.0: every token, no entropy treatment); ``low``, only the others (the masking
    paper's contrast, for ablations); ``archer``, every token, the top ``top_quantile`` of each
    response with a wider clip, the others with a KL (Archer); ``sent_kl``, every token, those below
    the step's threshold with a KL (after SENT). Each rule's docstring says what it does."""
    entropy_rule_options: EntryOptions("train.loss.entropy_rule") = Field(
        default_factory=entry_defaults("train.loss.entropy_rule"))
    """Each rule's own options under its name (``grpo.algorithm.entropy``: every rule's ``top_quantile``,
    ``archer``'s ``clip_high`` and ``kl_low``, ``sent_kl``'s ``kl_low``); the chosen rule's apply."""

    @model_validator(mode="after")
    def _check(self):
        """The chosen rule's check of its options (``grpo.algorithm.entropy.TokenRule.check``: one line naming the param)."""
        registry("train.loss.entropy_rule")[self.entropy_rule].check(self.rule_options())
        return self

    def rule_options(self, name: str | None = None):
        """The options of token rule ``name`` (default: the chosen one; ``None`` for a rule that
        declares none)."""
        return self.entropy_rule_options.get(name or self.entropy_rule)

    def clip(self) -> tuple[float, float]:
        """The ordinary clip range's two sides ``(epsilon, epsilon_high)``: the chosen policy term's
        options (``clipped``'s where it declares none; ``epsilon_high`` null: ``epsilon``)."""
        opts = self.policy_loss_options.get(self.policy_loss) or self.policy_loss_options["clipped"]
        return opts.epsilon, opts.epsilon if opts.epsilon_high is None else opts.epsilon_high


class PassesConfig(TrainPart):
    SECTION: ClassVar[str] = "train.passes"
    micro_batches: Positive = 1
    """Gradient accumulation: the step's completions are split into this many forward/backward
    chunks. The update is the same for any value (the entropy threshold and the loss normaliser
    are taken over the whole step); only memory and time change."""
    shared_prompt_forward: bool = True
    """The training and log-prob passes run each group's prompt once and its G completions on the
    shared KV cache (``grpo.algorithm.logprobs.completion_hidden``); off: every row runs its own prompt.
    Nothing is shared under gradient checkpointing. (Generation always prefills a prompt once.)"""
    forward_layout: Literal["auto", "padded", "packed"] = "auto"
    """How those passes lay out a group with ``shared_prompt_forward``: ``padded`` runs its G
    completions as G rows padded to the longest completion of the micro-batch, on the prompt's KV
    cache; ``packed`` runs the prompt and the G completions back to back as one sequence, a block
    mask keeping each completion to the prompt and itself (``grpo.algorithm.logprobs.packed_hidden``): no
    compute on padding, attention over the group's whole length; ``auto``: packed except on CUDA
    (where the padding costs little and the longer attention costs memory). The same update up to
    float reassociation."""
    kernel: Literal["auto", "triton", "torch"] = "auto"
    """Entropy/log-prob pass: ``triton`` (CUDA), ``torch``, or ``auto`` (triton when on CUDA)."""
    logprob_chunk: Positive = 1024
    """Rows (token positions) per chunk of the no-grad entropy/log-prob pass."""


class GuardsConfig(TrainPart):
    SECTION: ClassVar[str] = "train.guards"
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


class CheckpointsConfig(TrainPart):
    SECTION: ClassVar[str] = "train.checkpoints"
    every: NonNegative = 10
    """Write a resumable checkpoint every N steps (0: never)."""
    val_path: str = "data/raw/val.jsonl"
    """Validation problems for the evaluation during training (``prepare_data`` writes them)."""
    eval_every: NonNegative = 10
    """Greedy accuracy on ``val_path`` every N steps and after the last one, with the rollout
    backend (0: never)."""
    eval_max_new_tokens: Positive = 64
    """Length cap of the validation completions."""
    keep_best: bool = False
    """Write the adapter of the best validation accuracy (earliest on ties) as the stage's adapter
    instead of the last one; ``models/adapter/selection.json`` says which was written. Off by
    default: the validation split chooses the rule (``grpo.evaluation.ablations``), so it chooses no checkpoint
    of the shipped run."""


class DistributionConfig(TrainPart):
    SECTION: ClassVar[str] = "train.distribution"
    num_processes: Positive = 1
    """Data-parallel training processes on this machine (``grpo.core.distributed``): the stage launches
    them itself through torch.distributed's launcher, each with ``prompts_per_step /
    num_processes`` whole groups; the update equals one process's. gloo on CPUs, NCCL on GPUs
    (one GPU each). With engine rollouts each process holds its own engine: on a CPU that is
    ``num_processes`` shares of ``gpu_memory_utilization`` of the RAM (checked before launching)."""
    dist_timeout_s: PositiveFloat = 600.0
    """With several processes, from the first training step on: a collective that waits longer
    than this for another rank fails and takes the stage down (a rank that hangs, or a rank of
    another machine that is gone). Start-up (loading, an engine's start, resuming) is bounded by
    ``grpo.core.distributed.STARTUP_TIMEOUT_S`` instead: ranks reach the first step at different times."""
    deepspeed_config: str = ""
    """A DeepSpeed JSON (e.g. ``configs/accelerate/ds_zero2_offload.json``: ZeRO-2, AdamW state
    offloaded to CPU memory): the LoRA update runs through a DeepSpeed engine (``grpo.training.zero``) instead
    of the trainer's AdamW, gradient all-reduce and clipping. The JSON sets the ZeRO stage (1 or 2),
    offload and precision; lr, weight decay, clipping and accumulation stay these params'. Resume
    restarts AdamW's moments (the partitioned state is not checkpointed). Empty: no DeepSpeed."""


class WandbConfig(TrainPart):
    SECTION: ClassVar[str] = "train.wandb"
    mode: Literal["online", "offline", "disabled"] = "offline"
    """wandb: ``online``, ``offline`` or ``disabled``."""
    project: str = "grpo"
    """wandb project name."""
