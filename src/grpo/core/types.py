"""Records passed between rollout, reward and loss code; every tensor field documents its shape.

N = number of completions in the batch (prompts * G), P = padded prompt length,
C = padded completion length; with several processes n = this rank's completions and N_step the
whole step's (n = N_step with one process).

A sampler holds its calls to ``Lengths``. A step's phases hand these on: a generation backend returns a ``Rollout``; the rollout phase
returns ``StepRollouts`` (the rollout with its rewards and advantages); ``TrainBatch`` is that as
the update consumes it (on the training device, with the fixed log-probs of the no-grad passes),
sliced into micro-batches by rows; the update returns ``UpdateStats``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(frozen=True)
class Lengths:
    """The lengths a sampler holds every call to (both backends): the last ``max_prompt_tokens``
    tokens of each prompt (``None``: all of them) and no EOS before ``min_new_tokens`` tokens
    (``min_new_tokens == max_new_tokens``: fixed-length completions)."""

    max_prompt_tokens: int | None = None
    min_new_tokens: int = 0


@dataclass
class Rollout:
    """Sampled completions of a batch of prompts (completions of one prompt are contiguous)."""

    prompt_ids: Tensor
    """(N, P) int64, left-padded prompt tokens."""
    prompt_mask: Tensor
    """(N, P) int64, 1 on real prompt tokens, 0 on left padding."""
    completion_ids: Tensor
    """(N, C) int64, sampled tokens; positions after the first EOS hold padding."""
    completion_mask: Tensor
    """(N, C) int64, 1 up to and including the first EOS, 0 after it."""
    texts: list[str]
    """N decoded completions (special tokens skipped)."""
    logprobs: Tensor | None = None
    """(N, C) float32 sampling log-probs of the completion tokens, when the backend returns them."""
    finished: Tensor | None = None
    """(N,) bool, True where the completion ended on an EOS token, False where ``max_new_tokens``
    cut it off; ``None`` when the backend does not say."""

    @classmethod
    def concat(cls, parts: list[Rollout], pad_id: int) -> Rollout:
        """One rollout from several (generation micro-batches): prompts re-padded on the left,
        completions (and log-probs) on the right, to the longest of the parts."""
        if len(parts) == 1:
            return parts[0]
        p = max(r.prompt_ids.shape[1] for r in parts)
        c = max(r.completion_ids.shape[1] for r in parts)

        def pad(t: Tensor, width: int, value, left: bool) -> Tensor:
            extra = width - t.shape[1]
            return torch.nn.functional.pad(t, (extra, 0) if left else (0, extra), value=value)

        has_logprobs = all(r.logprobs is not None for r in parts)
        has_finished = all(r.finished is not None for r in parts)
        return cls(
            prompt_ids=torch.cat([pad(r.prompt_ids, p, pad_id, True) for r in parts]),  # (N, P)
            prompt_mask=torch.cat([pad(r.prompt_mask, p, 0, True) for r in parts]),  # (N, P)
            completion_ids=torch.cat([pad(r.completion_ids, c, pad_id, False) for r in parts]),  # (N, C)
            completion_mask=torch.cat([pad(r.completion_mask, c, 0, False) for r in parts]),  # (N, C)
            texts=[t for r in parts for t in r.texts],
            logprobs=torch.cat([pad(r.logprobs, c, 0.0, False) for r in parts]) if has_logprobs else None,
            finished=torch.cat([r.finished for r in parts]) if has_finished else None,  # (N,)
        )

    @property
    def input_ids(self) -> Tensor:
        """(N, P + C) prompt and completion tokens."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(N, P + C) 1 on real tokens."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)


@dataclass
class TrainBatch:
    """One optimizer step's completions as the loss consumes them; slicing takes rows."""

    input_ids: Tensor
    """(N, P + C) int64, prompt and completion tokens."""
    attention_mask: Tensor
    """(N, P + C) int64, 1 on real tokens."""
    targets: Tensor
    """(N, C) int64, the completion tokens (the labels of the completion positions)."""
    mask: Tensor
    """(N, C) int64, 1 on valid completion tokens (up to and including the first EOS)."""
    advantages: Tensor
    """(N,) float32, group-relative advantage of each completion."""
    prompt_len: int
    """P: the completion starts at this column of ``input_ids``."""
    old_logp: Tensor | None = None
    """(N, C) float32 log-probs under the sampling policy when ``mu > 1``; ``None``: on-policy (the
    detached current log-probs)."""
    ref_logp: Tensor | None = None
    """(N, C) float32 log-probs under the reference policy (adapter off) when ``beta > 0``."""
    sampling_logp: Tensor | None = None
    """(N, C) float32 log-probs the sampler reported for the sampled tokens (an inference engine's;
    ``None`` when the policy sampled itself)."""

    @classmethod
    def from_rollout(cls, rollout: Rollout, advantages: Tensor, device: torch.device) -> TrainBatch:
        return cls(
            input_ids=rollout.input_ids.to(device),
            attention_mask=rollout.attention_mask.to(device),
            targets=rollout.completion_ids.to(device),
            mask=rollout.completion_mask.to(device),
            advantages=advantages.to(device),
            prompt_len=rollout.prompt_ids.shape[1],
            sampling_logp=None if rollout.logprobs is None else rollout.logprobs.to(device),
        )

    def __len__(self) -> int:
        return self.input_ids.shape[0]

    def __getitem__(self, rows: slice | Tensor) -> TrainBatch:
        """The rows ``rows`` (a slice, or a (k,) index tensor) of every tensor field."""
        return TrainBatch(
            self.input_ids[rows], self.attention_mask[rows], self.targets[rows], self.mask[rows],
            self.advantages[rows], self.prompt_len,
            None if self.old_logp is None else self.old_logp[rows],
            None if self.ref_logp is None else self.ref_logp[rows],
            None if self.sampling_logp is None else self.sampling_logp[rows],
        )


@dataclass
class StepRollouts:
    """The rollout phase's record: this rank's completions of the step, scored."""

    rows: list[dict]
    """This rank's problems of the step (n / G), in prompt order."""
    first_prompt: int
    """The index of ``rows[0]`` among the whole step's prompts."""
    answers: list[str]
    """n reference answers, one per completion."""
    rollout: Rollout
    """This rank's n completions (G contiguous per prompt)."""
    rewards: list[float]
    """n weighted total rewards of this rank's completions."""
    step_rewards: Tensor
    """(N_step,) float32 total rewards of the whole step's completions (every rank's), prompt order."""
    step_reward_parts: dict[str, list[float]]
    """Reward function name -> N_step scores (``correctness`` always among them)."""
    advantages: Tensor
    """(n,) float32 group-relative advantages of this rank's completions (from ``step_rewards``)."""

    def samples(self, step: int) -> list[dict]:
        """The sampled completions with their question, answer and reward, for the samples log."""
        g = len(self.answers) // max(1, len(self.rows))
        return [{"step": step, "question": self.rows[i // g]["question"], "answer": self.answers[i],
                 "completion": text, "reward": self.rewards[i]} for i, text in enumerate(self.rollout.texts)]


@dataclass
class StepResult:
    """What one optimizer step reports."""

    grad_norm: float
    """The global gradient norm before clipping."""
    wait_s: float = 0.0
    """This rank's wait for the slowest rank before the gradient all-reduce (0 with one process)."""
    allreduce_s: float = 0.0
    """The gradient all-reduce itself."""
    optimizer_s: float = 0.0
    """Clipping, the optimizer step and clearing the gradients (with DeepSpeed: its whole step)."""
    applied: bool = True
    """False when the update was skipped (``skip``, or a non-finite gradient norm): the gradients
    were cleared, parameters and optimizer state left as they were."""


@dataclass
class UpdateStats:
    """The update phase's record (``mu`` optimizer steps over one ``TrainBatch``)."""

    sums: dict[str, float]
    """The update statistics by name (``grpo.training.metrics.UPDATE``), combined over the ``mu`` updates, and
    the counts (``grpo.training.metrics.COUNTS``) of the update's and the step's completions: this rank's."""
    grad_norm: float
    """The global gradient norm before clipping, of the last update."""
    times: dict[str, float] = field(default_factory=dict)
    applied: bool = True
    """False when an update of the step was skipped for a non-finite value (``Updater.step``)."""
    """``time_optimizer_s``, ``time_wait_s``, ``time_allreduce_s``: summed over the ``mu`` updates."""
