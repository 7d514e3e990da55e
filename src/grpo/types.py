"""Records passed between rollout, reward and loss code; every tensor field documents its shape.

N = number of completions in the batch (prompts * G), P = padded prompt length,
C = padded completion length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


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

    @property
    def input_ids(self) -> Tensor:
        """(N, P + C) prompt and completion tokens."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(N, P + C) 1 on real tokens."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)
