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
        return cls(
            prompt_ids=torch.cat([pad(r.prompt_ids, p, pad_id, True) for r in parts]),  # (N, P)
            prompt_mask=torch.cat([pad(r.prompt_mask, p, 0, True) for r in parts]),  # (N, P)
            completion_ids=torch.cat([pad(r.completion_ids, c, pad_id, False) for r in parts]),  # (N, C)
            completion_mask=torch.cat([pad(r.completion_mask, c, 0, False) for r in parts]),  # (N, C)
            texts=[t for r in parts for t in r.texts],
            logprobs=torch.cat([pad(r.logprobs, c, 0.0, False) for r in parts]) if has_logprobs else None,
        )

    @property
    def input_ids(self) -> Tensor:
        """(N, P + C) prompt and completion tokens."""
        return torch.cat([self.prompt_ids, self.completion_ids], dim=1)

    @property
    def attention_mask(self) -> Tensor:
        """(N, P + C) 1 on real tokens."""
        return torch.cat([self.prompt_mask, self.completion_mask], dim=1)
