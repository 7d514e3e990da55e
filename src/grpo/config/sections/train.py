"""The ``train`` section: the GRPO run. Its own keys (the data, the order, the seeds, the length
of the run, its rewards, where it writes) at the top, and one part each for the rollouts, the
optimizer, the loss, the passes, the guards, checkpoints and validation, distribution and wandb
(``grpo.config.sections.train_parts``). Its keys that other stages read too (the system prompt, the
metrics folder, the adapter's folder) are ``grpo.config.sections.shared``'s, so those stages do not
depend on this file."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from grpo.config.choices import Choice, EntryOptions, entry_defaults, registry
from grpo.config.reading import Params, ParamsError
from grpo.config.sections.shared import SharedTrainKeys
from grpo.config.sections.train_parts import (
    MOVED,
    CheckpointsConfig,
    DistributionConfig,
    GuardsConfig,
    LossConfig,
    OptimizerConfig,
    PassesConfig,
    RolloutsConfig,
    WandbConfig,
)
from grpo.core.fields import Positive


class TrainConfig(SharedTrainKeys):
    SECTION: ClassVar[str] = "train"
    MOVED: ClassVar[dict[str, str]] = MOVED
    data_path: str = "data/cache/train_sorted.jsonl"
    """JSONL of training problems (id, question, answer); the SENT stage writes it sorted easy -> hard."""
    order: Choice("train.order") = "curriculum"
    """``curriculum``: ``num_stages`` slices of the file trained in order, shuffled within each;
    ``reversed``: the same slices hardest first (the anti-curriculum); ``shuffled``: one seeded permutation of all rows (the comparison without curriculum); ``file``: file order."""
    order_options: EntryOptions("train.order") = Field(default_factory=entry_defaults("train.order"))
    """Each order's own options under its name (``grpo.algorithm.curriculum``: ``num_stages`` of ``curriculum``
    and ``reversed``); the chosen order's apply."""
    output_dir: str = "outputs/train"
    """Checkpoints and logs of the run (persisted across restarts for resume)."""
    seed: int = 0
    """Seed of sampling, shuffling and LoRA initialisation."""
    deterministic: bool = False
    """Before the model is built, turn on torch's deterministic algorithms (an op without a
    deterministic variant warns), SDPA's math attention and cuBLAS's fixed-order workspace
    (``grpo.core.device.make_deterministic``): slower; what it does and does not make equal on CUDA:
    docs/gpu-notes.md. Off: the CPU's bytes are equal run to run without it."""
    steps: Positive = 40
    """Optimizer steps."""
    rewards: dict[Choice("train.rewards"), float] = Field(default_factory=lambda: {"correctness": 1.0})
    """Reward function name -> weight; the total reward is the weighted sum."""
    truncated: Literal["zero", "score"] = "zero"
    """A completion that ``train.rollouts.max_new_tokens`` cut off (no EOS): ``zero`` gives it reward 0
    from every reward function (it never stated its final answer; the last number of a cut-off text
    is usually an intermediate one), ``score`` scores its text like any other."""
    rollouts: RolloutsConfig = Field(default_factory=RolloutsConfig)
    """Sampling the step's completions: how many, how long, by whom (``grpo.config.sections.train_parts``)."""
    optimizer: OptimizerConfig = Field(default_factory=OptimizerConfig)
    """AdamW on the LoRA parameters, its schedule, and the updates per batch of rollouts."""
    loss: LossConfig = Field(default_factory=LossConfig)
    """The policy term, its aggregation, the advantage, and the token-entropy rule."""
    passes: PassesConfig = Field(default_factory=PassesConfig)
    """How the training and log-prob passes run (memory and time only: the same update)."""
    guards: GuardsConfig = Field(default_factory=GuardsConfig)
    """What stops a run that goes wrong."""
    checkpoints: CheckpointsConfig = Field(default_factory=CheckpointsConfig)
    """Resumable checkpoints, the validation during training, and which adapter ships."""
    distribution: DistributionConfig = Field(default_factory=DistributionConfig)
    """Data-parallel processes and DeepSpeed."""
    wandb: WandbConfig = Field(default_factory=WandbConfig)
    """Where wandb logs."""

    @model_validator(mode="after")
    def _check(self):
        if not self.rewards:
            raise ValueError("train.rewards: name at least one reward function")
        self.check_split(self.distribution.num_processes, "train.distribution.num_processes")
        return self

    def check_split(self, processes: int, source: str = "the launcher's WORLD_SIZE") -> None:
        """Raise unless ``prompts_per_step`` splits evenly over ``processes`` (whole groups per
        process); ``source`` names where the process count comes from."""
        if self.rollouts.prompts_per_step % processes:
            raise ParamsError(f"train.rollouts.prompts_per_step: {self.rollouts.prompts_per_step} prompts do not split evenly over "
                              f"{processes} processes ({source}; whole groups per process)")


def check_across_sections(params: Params) -> Params:
    """The rules that tie two sections together; ``ParamsError`` naming the key. The chosen weights
    form's own rule (``WeightsForm.check_params``: nf4 needs ``model.quantization: nf4``)."""
    forms = registry("train.rollouts.engine_weights")
    if params.train.rollouts.engine_weights in forms:  # not auto
        forms[params.train.rollouts.engine_weights].check_params(params)
    return params
