"""Per-token log-probs and entropies of completions, computed where they are needed.

The training forward runs the decoder body once, with grad, to get the final hidden states of
the completion positions, then splits the LM head in two:

1. ``chunked_entropy_logprobs`` (no grad): entropy and log-prob of the sampled token at every
   completion position, ``chunk`` rows at a time, through the fused kernel. Peak extra memory is
   one (chunk, V) logits block, never (N, C, V) in fp32.
2. ``selected_logprobs`` (grad): the LM head and log-softmax only at the positions kept by the
   entropy mask. Elsewhere the loss sees the detached values of step 1 and sends no gradient.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.kernels import entropy_logprob


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(N, L) positions that skip left padding, as ``generate`` assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_hidden(body, input_ids: Tensor, attention_mask: Tensor, prompt_len: int) -> Tensor:
    """Final hidden states at the positions that predict each completion token.

    input_ids, attention_mask: (N, P + C). Returns (N, C, H): row t predicts completion token t.
    """
    out = body(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids_from_mask(attention_mask),
        use_cache=False,
    )
    return out.last_hidden_state[:, prompt_len - 1 : -1]  # (N, C, H)


@torch.no_grad()
def chunked_entropy_logprobs(
    hidden: Tensor, lm_head: torch.nn.Module, targets: Tensor, chunk: int = 1024, backend: str = "auto"
) -> tuple[Tensor, Tensor]:
    """Entropy and target log-prob at every position, without grad.

    hidden: (N, C, H); targets: (N, C). Returns two (N, C) fp32 tensors.
    """
    n, c, h = hidden.shape
    flat_h = hidden.reshape(n * c, h)  # (R, H)
    flat_t = targets.reshape(n * c)  # (R,)
    ent = torch.empty(n * c, dtype=torch.float32, device=hidden.device)
    logp = torch.empty(n * c, dtype=torch.float32, device=hidden.device)
    for start in range(0, n * c, chunk):
        logits = lm_head(flat_h[start : start + chunk])  # (chunk, V), model dtype
        ent[start : start + chunk], logp[start : start + chunk] = entropy_logprob(
            logits, flat_t[start : start + chunk], backend
        )
        del logits
    return ent.view(n, c), logp.view(n, c)


def selected_logprobs(hidden_rows: Tensor, lm_head: torch.nn.Module, targets: Tensor) -> Tensor:
    """Log-prob of ``targets`` with grad: hidden_rows (K, H), targets (K,) -> (K,) fp32."""
    logits = lm_head(hidden_rows).float()  # (K, V)
    return logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)
