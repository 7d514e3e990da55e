"""Token entropy and the high-entropy token mask: pure tensor functions.

Following "Beyond the 80/20 Rule" (arXiv 2506.01939): only the ``top_quantile`` fraction of valid
completion tokens with the highest predictive entropy ("forking tokens") receive policy
gradient. The threshold is the ``1 - top_quantile`` quantile of the entropies of all valid
completion tokens in the batch (linear interpolation, as ``torch.quantile``); tokens at or above
it are kept. Padding and prompt tokens are never kept. Ties at the threshold are all kept, so
the kept fraction can exceed ``top_quantile`` slightly.

"The batch" is the whole optimizer step: a trainer that splits the step into micro-batches (or
over processes) computes ``entropy_threshold`` once over all of the step's valid tokens and
passes it to ``high_entropy_mask`` for every part, so the split changes memory, not the tokens
that learn.
"""

from __future__ import annotations

import torch
from torch import Tensor


def token_entropy(logits: Tensor) -> Tensor:
    """Entropy of softmax(logits) over the last dim, in fp32: (..., V) -> (...)."""
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1, keepdim=True)  # (..., 1)
    probs = torch.exp(logits - lse)  # (..., V)
    return lse.squeeze(-1) - (probs * logits).sum(-1)


def entropy_threshold(values: Tensor, top_quantile: float) -> Tensor | None:
    """The ``1 - top_quantile`` quantile of ``values`` (1-D: the entropies of all valid tokens of
    the step), or ``None`` (keep every valid token) when ``top_quantile >= 1`` or there are none."""
    if not 0 < top_quantile <= 1:
        raise ValueError(f"top_quantile must be in (0, 1], got {top_quantile}")
    if top_quantile >= 1 or values.numel() == 0:
        return None
    return torch.quantile(values.float(), 1.0 - top_quantile)


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float, threshold: Tensor | None = None,
                      keep: str = "high") -> Tensor:
    """Boolean mask of the highest-entropy valid tokens (``keep="high"``), or of the others
    (``keep="low"``: the valid tokens below the threshold, the complement within ``mask``).

    entropy: (N, T); mask: (N, T), true/1 on valid completion tokens. Returns a (N, T) bool tensor
    that is a subset of ``mask``. ``top_quantile = 1`` keeps every valid token. ``threshold``: the
    step-wide value from ``entropy_threshold`` when these rows are part of a larger step; by
    default it is taken over the valid tokens given here.
    """
    if keep not in ("high", "low"):
        raise ValueError(f"keep must be 'high' or 'low', got {keep!r}")
    valid = mask.bool()
    if threshold is None:
        threshold = entropy_threshold(entropy[valid], top_quantile)
    if threshold is None:
        return valid.clone()
    if keep == "low":
        return (entropy < threshold) & valid
    return (entropy >= threshold) & valid
