"""The ``train`` section: the GRPO run. Its keys that other stages read too (the system prompt, the
metrics folder) are ``grpo.sections.shared``'s, so those stages do not depend on this file."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from grpo.config import (
    Choice,
    EntryOptions,
    Fraction,
    NonNegative,
    Params,
    ParamsError,
    Positive,
    PositiveFloat,
    entry_defaults,
)
from grpo.sections.engine import VLLMEngineConfig
from grpo.sections.shared import SharedTrainKeys


class TrainConfig(SharedTrainKeys, VLLMEngineConfig):
    SECTION: ClassVar[str] = "train"
    MOVED: ClassVar[dict[str, str]] = {
        "num_stages": "train.order_options.curriculum.num_stages (and .reversed.num_stages)",
        "entropy_clip_high": "train.entropy_rule_options.archer.clip_high",
        "entropy_kl_low": "train.entropy_rule_options.sent_kl.kl_low (and .archer.kl_low)",
    }
    data_path: str = "data/cache/train_sorted.jsonl"
    """JSONL of training problems (id, question, answer); the SENT stage writes it sorted easy -> hard."""
    order: Choice("train.order") = "curriculum"
    """``curriculum``: ``num_stages`` slices of the file trained in order, shuffled within each;
    ``reversed``: the same slices hardest first (the anti-curriculum); ``shuffled``: one seeded permutation of all rows (the comparison without curriculum); ``file``: file order."""
    order_options: EntryOptions("train.order") = Field(default_factory=entry_defaults("train.order"))
    """Each order's own options under its name (``grpo.curriculum``: ``num_stages`` of ``curriculum``
    and ``reversed``); the chosen order's apply."""
    output_dir: str = "outputs/train"
    """Checkpoints and logs of the run (persisted across restarts for resume)."""
    adapter_dir: str = "models/adapter"
    """Final adapter, PEFT format."""
    seed: int = 0
    """Seed of sampling, shuffling and LoRA initialisation."""
    deterministic: bool = False
    """Before the model is built, turn on torch's deterministic algorithms (an op without a
    deterministic variant warns), SDPA's math attention and cuBLAS's fixed-order workspace
    (``grpo.device.make_deterministic``): slower; what it does and does not make equal on CUDA:
    docs/gpu-notes.md. Off: the CPU's bytes are equal run to run without it."""
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
    entropy (the default ``archer``, with ``mu`` 2, chosen by the decision rule of docs/results.md): ``high``, only the top ``entropy_top_quantile`` get gradient (arXiv 2506.01939);
    ``low``, only the others (the masking paper's contrast, for ablations); ``archer``, every token,
    the top ``entropy_top_quantile`` of each response with a wider clip, the others with a KL
    (Archer); ``sent_kl``, every token, those below the step's threshold with a KL (after SENT).
    Each rule's docstring says what it does; its options are under ``entropy_rule_options``."""
    entropy_rule_options: EntryOptions("train.entropy_rule") = Field(
        default_factory=entry_defaults("train.entropy_rule"))
    """Each rule's own options under its name (``grpo.entropy``: ``archer``'s ``clip_high`` and
    ``kl_low``, ``sent_kl``'s ``kl_low``); the chosen rule's apply."""
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


def check_across_sections(params: Params) -> Params:
    """The rules that tie two sections together; ``ParamsError`` naming the key. The chosen weights
    form's own rule (``WeightsForm.check_params``: nf4 needs ``model.quantization: nf4``)."""
    from grpo.choices import registry

    forms = registry("train.engine_weights")
    if params.train.engine_weights in forms:  # not auto
        forms[params.train.engine_weights].check_params(params)
    return params
