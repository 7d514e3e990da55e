"""Autoregressive sampling with a KV cache: shared prompt prefill, finished rows leave the batch.

``decode`` is the generation loop of ``TransformersBackend`` (it replaces ``model.generate``):

1. prefill: each distinct prompt runs once and its KV cache is repeated for its ``num_samples``
   completions (a GRPO group shares one prompt; prefilling G copies would cost G times as much);
2. step: the last logits of every live row -> temperature / top-p -> one token per row
   (``sample_tokens``: inverse-CDF sampling, one uniform number per row, instead of
   ``torch.multinomial``, which draws one exponential variate per vocabulary entry);
3. a row that emits EOS leaves the batch (its cache rows are dropped), so later steps compute
   only the rows still generating; the loop ends when none is left or after ``max_new_tokens``.

EOS is suppressed for the first ``min_new_tokens`` tokens. Greedy decoding (temperature 0) gives
the same tokens as ``model.generate`` (tested). With ``row_seeds`` each completion draws its
uniform numbers from a generator of its own (``row_uniforms``), so a completion's tokens do not
depend on which other prompts share the call (a data-parallel rank samples its share of a step
exactly as one process samples the whole step, up to float rounding); without, from the global
torch generator.
"""

from __future__ import annotations

import torch
from torch import Tensor

from grpo.logprobs import position_ids_from_mask


def row_uniforms(row_seeds: list[int], length: int) -> Tensor:
    """(N, length) uniform numbers in [0, 1), row i from a generator seeded with ``row_seeds[i]``."""
    return torch.stack([torch.rand(length, generator=torch.Generator().manual_seed(s)) for s in row_seeds])


def sample_tokens(logits: Tensor, temperature: float = 1.0, top_p: float = 1.0,
                  generator: torch.Generator | None = None, uniforms: Tensor | None = None) -> Tensor:
    """One token per row of ``logits`` (n, V): argmax at temperature 0, else a draw from
    softmax(logits / temperature) restricted to the smallest top-p nucleus (at least one token).
    ``uniforms``: (n,) the rows' uniform numbers in [0, 1) (default: drawn from ``generator``)."""
    if temperature <= 0:
        return logits.argmax(-1)
    probs = torch.softmax(logits.float() / temperature, dim=-1)  # (n, V)
    order = None
    if top_p < 1.0:
        probs, order = probs.sort(dim=-1, descending=True)
        outside = probs.cumsum(-1) - probs > top_p  # mass before this token already covers top_p
        probs = probs.masked_fill(outside, 0.0)
    cdf = probs.cumsum(-1)  # (n, V)
    if uniforms is None:
        uniforms = torch.rand(cdf.shape[0], device=cdf.device, generator=generator)  # (n,)
    u = uniforms.to(cdf.device, cdf.dtype).unsqueeze(1) * cdf[:, -1:]  # (n, 1)
    idx = torch.searchsorted(cdf, u, right=True).clamp_(max=cdf.shape[1] - 1)  # (n, 1)
    if order is not None:
        idx = order.gather(-1, idx)
    return idx.squeeze(-1)


@torch.no_grad()
def decode(model, ids: Tensor, mask: Tensor, num_samples: int, *, max_new_tokens: int, eos_ids: set[int],
           pad_id: int, temperature: float = 1.0, top_p: float = 1.0, min_new_tokens: int = 0,
           row_seeds: list[int] | None = None) -> Tensor:
    """Sample ``num_samples`` completions of each left-padded prompt.

    ids, mask: (B, P) distinct prompts. ``row_seeds``: B * num_samples seeds, one per completion
    (see the module docstring). Returns (B * num_samples, C) completion tokens, C <=
    ``max_new_tokens``, completions of a prompt contiguous; after a row's EOS: ``pad_id``.
    """
    b, p = ids.shape
    n, device = b * num_samples, ids.device
    eos = torch.tensor(sorted(eos_ids), device=device)
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True,
                logits_to_keep=1)
    cache = out.past_key_values
    logits = out.logits[:, -1].float().repeat_interleave(num_samples, 0)  # (N, V)
    cache.batch_repeat_interleave(num_samples)
    attn = mask.repeat_interleave(num_samples, 0)  # (N, P + t)
    position = position_ids_from_mask(attn)[:, -1] + 1  # (N,) position of the next token
    tokens = torch.full((n, max_new_tokens), pad_id, dtype=torch.long, device=device)  # (N, max_new)
    live = torch.arange(n, device=device)  # rows of ``tokens`` still generating
    uniforms = None if row_seeds is None else row_uniforms(row_seeds, max_new_tokens).to(device)  # (N, max_new)
    length = 0
    for t in range(max_new_tokens):
        if t < min_new_tokens:
            logits[:, eos] = float("-inf")
        nxt = sample_tokens(logits, temperature, top_p,
                            uniforms=None if uniforms is None else uniforms[live, t])  # (n_live,)
        tokens[live, t] = nxt
        length = t + 1
        going = ~torch.isin(nxt, eos)
        if t == max_new_tokens - 1 or not going.any():
            break
        if not going.all():  # finished rows leave the batch
            keep = going.nonzero().squeeze(1)
            live, nxt, attn, position = live[keep], nxt[keep], attn[keep], position[keep]
            cache.batch_select_indices(keep)
        attn = torch.cat([attn, attn.new_ones(attn.shape[0], 1)], dim=1)
        out = model(input_ids=nxt[:, None], attention_mask=attn, position_ids=position[:, None],
                    past_key_values=cache, use_cache=True)
        logits = out.logits[:, -1].float()  # (n_live, V)
        position = position + 1
    return tokens[:, :length]
