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

from grpo.algorithm.kernels import entropy_logprob, logprob_grad


def position_ids_from_mask(attention_mask: Tensor) -> Tensor:
    """(N, L) positions that skip left padding, as ``generate`` assigns them."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def completion_hidden(body, input_ids: Tensor, attention_mask: Tensor, prompt_len: int, group_size: int = 1,
                      packed: bool = False) -> Tensor:
    """Final hidden states at the positions that predict each completion token.

    input_ids, attention_mask: (N, P + C); a completion's valid tokens are a prefix of its C
    positions. Returns (N, C, H): row t predicts completion token t (the states at padding
    positions are not meant to be used).

    ``group_size`` G > 1 says that rows come in groups of G with the same prompt (a GRPO batch).
    Then each prompt runs once, and its KV cache and last hidden state are repeated for its G
    completions, which run on top of them: the prompt part of the forward costs 1/G of the full
    one, and in backward the gradients of the G copies sum into the one shared pass, exactly as
    they would over G separate ones. With ``packed`` the group runs as one sequence instead
    (``packed_hidden``: no padding inside a group, no KV cache, so it also runs under gradient
    checkpointing). The same function up to float reassociation (tested). Falls back to one full
    forward when the rows are not such groups, or (not packed) when the body checkpoints
    activations (a KV cache is not built under gradient checkpointing).
    """
    n, g = input_ids.shape[0], group_size
    positions = position_ids_from_mask(attention_mask)  # (N, P + C)
    shareable = (
        g > 1 and n % g == 0 and prompt_len > 0 and input_ids.shape[1] > prompt_len
        and (packed or not (getattr(body, "gradient_checkpointing", False) and body.training))
    )
    if shareable:
        p_ids, p_mask = input_ids[::g, :prompt_len], attention_mask[::g, :prompt_len]  # (N / G, P)
        shareable = torch.equal(p_ids.repeat_interleave(g, 0), input_ids[:, :prompt_len]) and torch.equal(
            p_mask.repeat_interleave(g, 0), attention_mask[:, :prompt_len])
    if not shareable:
        out = body(input_ids=input_ids, attention_mask=attention_mask, position_ids=positions, use_cache=False)
        return out.last_hidden_state[:, prompt_len - 1 : -1]  # (N, C, H)
    if packed:
        return packed_hidden(body, input_ids, attention_mask, positions, prompt_len, g)
    prompt = body(input_ids=p_ids, attention_mask=p_mask, position_ids=positions[::g, :prompt_len], use_cache=True)
    cache = prompt.past_key_values
    cache.batch_repeat_interleave(g)  # per layer (N, kv_heads, P, d), differentiable
    last = prompt.last_hidden_state[:, -1:].repeat_interleave(g, 0)  # (N, 1, H): predicts completion token 0
    if input_ids.shape[1] - prompt_len == 1:
        return last
    rest = body(
        input_ids=input_ids[:, prompt_len:-1], attention_mask=attention_mask[:, :-1],
        position_ids=positions[:, prompt_len:-1], past_key_values=cache, use_cache=True,
    )
    return torch.cat([last, rest.last_hidden_state], dim=1)  # (N, C, H)


def packed_layout(forward_layout: str, device_type: str) -> bool:
    """Whether ``train.passes.forward_layout`` packs each group into one sequence on a ``device_type``
    (``"cuda"``, ``"cpu"``) device: ``packed``, or ``auto`` anywhere but CUDA."""
    return forward_layout == "packed" or (forward_layout == "auto" and device_type != "cuda")


def packed_hidden(body, input_ids: Tensor, attention_mask: Tensor, positions: Tensor, prompt_len: int,
                  group_size: int) -> Tensor:
    """``completion_hidden`` of rows in groups of G sharing a prompt, one sequence per group.

    A group's sequence is its prompt (P positions, left padding kept) followed by each completion's
    fed tokens (all but its last valid token, which predicts nothing), back to back, then right
    padding to the longest group (``pack_groups``). The additive mask lets a prompt token see the
    valid prompt tokens up to it, and a completion token the valid prompt tokens and its own
    completion up to it; each token keeps the position id it has in its own row. So every
    completion sees exactly what it sees in its own padded row: the same states up to float
    reassociation, without the padding's compute. Attention grows as S^2 per group instead of
    G C (P + C), which is why ``train.passes.forward_layout: auto`` packs only off CUDA.
    """
    ids, pos, mask, rows, index = pack_groups(input_ids, attention_mask, positions, prompt_len, group_size,
                                              body.get_input_embeddings().weight.dtype)  # the states' dtype
    states = body(input_ids=ids, attention_mask=mask, position_ids=pos, use_cache=False).last_hidden_state  # (N / G, S, H)
    return states[rows.unsqueeze(1), index]  # (N, C, H); padding positions read the prompt's last state


def pack_groups(input_ids: Tensor, attention_mask: Tensor, positions: Tensor, prompt_len: int, group_size: int,
                dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The packed inputs of ``packed_hidden``: token ids and position ids (N / G, S), the additive
    mask (N / G, 1, S, S) in ``dtype``, and for each row its sequence (N,) and the (N, C) positions
    in it of the states that predict its completion tokens. S = P + the longest group's sum of
    (L_j - 1), against the G (P + C) positions of the padded rows."""
    n, g, p = input_ids.shape[0], group_size, prompt_len
    c, dev = input_ids.shape[1] - p, input_ids.device
    lengths = completion_lengths(attention_mask[:, p:])  # (N,)
    fed = (lengths - 1).clamp(min=0).view(-1, g)  # (N / G, G) tokens each completion feeds
    starts = (p + fed.cumsum(1) - fed).reshape(n)  # (N,) sequence index of each completion's first fed token
    s = p + int(fed.sum(1).max())
    offsets = torch.arange(c - 1, device=dev)  # (C - 1,)
    here = offsets < fed.reshape(n, 1)  # (N, C - 1): the fed tokens
    rows = torch.arange(n, device=dev) // g  # (N,) each row's sequence
    seq, at = rows.unsqueeze(1).expand(-1, c - 1)[here], (starts.unsqueeze(1) + offsets)[here]  # (F,) each
    ids, pos = input_ids.new_zeros(n // g, s), positions.new_zeros(n // g, s)  # (N / G, S)
    ids[:, :p], pos[:, :p] = input_ids[::g, :p], positions[::g, :p]
    ids[seq, at], pos[seq, at] = input_ids[:, p:-1][here], positions[:, p:-1][here]
    segment = torch.full((n // g, s), -1, dtype=torch.long, device=dev)  # 0 prompt, j + 1 completion j, -1 padding
    segment[:, :p] = torch.where(attention_mask[::g, :p].bool(), 0, -1)
    segment[seq, at] = (torch.arange(n, device=dev) % g + 1).unsqueeze(1).expand(-1, c - 1)[here]
    key, query = segment.unsqueeze(1), segment.unsqueeze(2)  # (N / G, 1, S), (N / G, S, 1)
    allowed = (key >= 0) & ((key == 0) | (key == query)) & torch.ones(s, s, dtype=torch.bool, device=dev).tril()
    mask = torch.zeros(n // g, 1, s, s, dtype=dtype, device=dev).masked_fill(
        ~allowed.unsqueeze(1), torch.finfo(dtype).min)  # (N / G, 1, S, S)
    t = torch.arange(c, device=dev)  # (C,)
    index = torch.where((t > 0) & (t < lengths.unsqueeze(1)), starts.unsqueeze(1) + t - 1, p - 1)  # (N, C)
    return ids, pos, mask, rows, index


def completion_lengths(mask: Tensor) -> Tensor:
    """(N,) the positions up to each row's last valid one, from its (N, C >= 1) completion mask."""
    steps = torch.arange(1, mask.shape[1] + 1, device=mask.device)  # (C,)
    return (mask.bool() * steps).amax(1)


@torch.no_grad()
def chunked_entropy_logprobs(
    hidden: Tensor, lm_head: torch.nn.Module, targets: Tensor, chunk: int = 1024, backend: str = "auto",
    mask: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Entropy and target log-prob at every position, without grad.

    hidden: (N, C, H); targets: (N, C); mask: (N, C) or ``None``. Returns two (N, C) fp32 tensors.
    With ``mask``, only its nonzero positions go through the head; the others hold 0 in both.
    """
    n, c, h = hidden.shape
    flat_h = hidden.reshape(n * c, h)  # (R, H)
    flat_t = targets.reshape(n * c)  # (R,)
    rows = None if mask is None else mask.reshape(n * c).nonzero().squeeze(1)  # (R_valid,)
    if rows is not None:
        flat_h, flat_t = flat_h[rows], flat_t[rows]
    r = flat_h.shape[0]
    ent = torch.empty(r, dtype=torch.float32, device=hidden.device)
    logp = torch.empty(r, dtype=torch.float32, device=hidden.device)
    for start in range(0, r, chunk):
        logits = lm_head(flat_h[start : start + chunk])  # (chunk, V), model dtype
        ent[start : start + chunk], logp[start : start + chunk] = entropy_logprob(
            logits, flat_t[start : start + chunk], backend
        )
        del logits
    if rows is not None:
        ent = torch.zeros(n * c, dtype=torch.float32, device=hidden.device).index_copy_(0, rows, ent)
        logp = torch.zeros(n * c, dtype=torch.float32, device=hidden.device).index_copy_(0, rows, logp)
    return ent.view(n, c), logp.view(n, c)


def selected_logprobs(hidden_rows: Tensor, lm_head: torch.nn.Module, targets: Tensor, chunk: int = 1024,
                      backend: str = "auto") -> Tensor:
    """Log-prob of ``targets`` with grad: hidden_rows (K, H), targets (K,) -> (K,) fp32.

    The value and gradients of ``log_softmax(lm_head(h).float())[target]``, without an fp32 (K, V)
    tensor or any (K, V) tensor saved for backward. ``chunk`` rows at a time, the logits (in the
    model dtype) are overwritten by ``onehot - softmax`` (``grpo.algorithm.kernels.logprob_grad``), and the
    gradient with respect to the hidden row is taken at once through the head:
    ``d_k = (onehot - softmax)_k @ W`` (through ``lm_head``'s own backward, so a bias, tied weights
    or an adapter on the head count). Each output depends on its own row only, so the backward is
    ``grad_h_k = g_k * d_k``: no logits are recomputed, and the forward and backward cost the two
    (K, H, V) matmuls that autograd would. Only when a parameter of the head requires grad (a
    trained head, trained tied embeddings) does the backward recompute each chunk's logits for its
    gradient ``sum_k g_k (onehot - softmax)_k^T h_k``. Saved: the (K, H) hidden rows and ``d``,
    the targets and the (K,) log-sum-exp.
    """
    params = [p for p in lm_head.parameters() if p.requires_grad]
    return _HeadLogprob.apply(hidden_rows, targets, lm_head, chunk, backend, *params)


def _chunk_grad(lm_head, h, targets, backend, need_h: bool) -> tuple[Tensor, Tensor, Tensor | None, Tensor]:
    """One chunk: the logits (graph output when ``need_h``, overwritten by ``onehot - softmax``),
    lse (r,), logp (r,) and ``d`` (r, H) or ``None``; returns (lse, logp, d, logits)."""
    h = h.detach().requires_grad_(need_h)
    with torch.enable_grad():
        logits = lm_head(h)  # (r, V), model dtype
    lse, logp = logprob_grad(logits.detach(), targets, backend)  # logits now hold d logp / d logits
    d = torch.autograd.grad(logits, h, logits.detach())[0] if need_h else None  # (r, H)
    return lse, logp, d, logits


class _HeadLogprob(torch.autograd.Function):
    """``selected_logprobs``' value and backward (see its docstring)."""

    @staticmethod
    def forward(ctx, hidden, targets, lm_head, chunk, backend, *params):
        need_h = ctx.needs_input_grad[0]
        k = hidden.shape[0]
        lse = torch.empty(k, dtype=torch.float32, device=hidden.device)
        logp = torch.empty(k, dtype=torch.float32, device=hidden.device)
        d = torch.empty_like(hidden) if need_h else None  # (K, H)
        for start in range(0, k, chunk):
            rows = slice(start, start + chunk)
            lse[rows], logp[rows], d_rows, logits = _chunk_grad(lm_head, hidden[rows], targets[rows], backend, need_h)
            del logits
            if need_h:
                d[rows] = d_rows
        ctx.lm_head, ctx.chunk, ctx.backend = lm_head, chunk, backend
        ctx.save_for_backward(hidden, targets, lse, d)
        return logp

    @staticmethod
    def backward(ctx, grad):
        hidden, targets, lse, d = ctx.saved_tensors
        params = ctx.needs_input_grad[5:]
        grad_h = (d.float() * grad.unsqueeze(-1)).to(d.dtype) if ctx.needs_input_grad[0] else None
        grad_params = _param_grads(ctx, hidden, targets, grad) if any(params) else [None] * len(params)
        return grad_h, None, None, None, None, *grad_params


def _param_grads(ctx, hidden: Tensor, targets: Tensor, grad: Tensor) -> list[Tensor | None]:
    """Gradients of the head's trainable parameters: each chunk's logits recomputed, their gradient
    ``g_k (onehot - softmax)_k`` sent through the head's own backward."""
    params = [p for p in ctx.lm_head.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for start in range(0, hidden.shape[0], ctx.chunk):
        rows = slice(start, start + ctx.chunk)
        _, _, _, logits = _chunk_grad(ctx.lm_head, hidden[rows], targets[rows], ctx.backend, False)
        out = logits.detach().mul_(grad[rows].unsqueeze(-1).to(logits.dtype))  # (r, V): g * (onehot - softmax)
        for acc, g in zip(total, torch.autograd.grad(logits, params, out, allow_unused=True)):
            if g is not None:
                acc += g
        del logits, out
    return total
