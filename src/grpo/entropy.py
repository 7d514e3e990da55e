"""Token entropy and the high-entropy token mask: pure tensor functions.

Following "Beyond the 80/20 Rule" (arXiv 2506.01939): only the ``top_quantile`` fraction of valid
completion tokens with the highest predictive entropy ("forking tokens") receive policy
gradient. The threshold is the ``1 - top_quantile`` quantile of the entropies of all valid
completion tokens in the batch (linear interpolation, as ``torch.quantile``); tokens at or above
it are kept. Padding and prompt tokens are never kept. Ties at the threshold are all kept, so
the kept fraction can exceed ``top_quantile`` slightly.
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


def high_entropy_mask(entropy: Tensor, mask: Tensor, top_quantile: float) -> Tensor:
    """Boolean mask of the highest-entropy valid tokens.

    entropy: (N, T); mask: (N, T), true/1 on valid completion tokens. Returns a (N, T) bool tensor
    that is a subset of ``mask``. ``top_quantile = 1`` keeps every valid token.
    """
    if not 0 < top_quantile <= 1:
        raise ValueError(f"top_quantile must be in (0, 1], got {top_quantile}")
    valid = mask.bool()
    if not valid.any():
        return valid
    if top_quantile >= 1:
        return valid.clone()
    values = entropy[valid].float()  # (n_valid,)
    threshold = torch.quantile(values, 1.0 - top_quantile)
    return (entropy >= threshold) & valid
