"""Autoregressive sampling with a KV cache: the decode loop of ``TransformersBackend``.

``decode`` replaces ``model.generate`` and has two loops (``DECODE_LOOPS``), which give the same
tokens for the same ``row_seeds`` (tested):

``dynamic`` (the CPU's; ``DynamicCache``):

1. prefill: each distinct prompt runs once and its KV cache is repeated for its ``num_samples``
   completions (a GRPO group shares one prompt; prefilling G copies would cost G times as much);
2. step: the last logits of every live row -> temperature / top-p -> one token per row
   (``sample_tokens``: inverse-CDF sampling, one uniform number per row, instead of
   ``torch.multinomial``, which draws one exponential variate per vocabulary entry);
3. a row that emits EOS leaves the batch (its cache rows are dropped), so later steps compute
   only the rows still generating; the loop ends when none is left or after ``max_new_tokens``.
   Where compute is the bottleneck (a CPU), the rows that leave are work saved.

``static`` (CUDA's; ``transformers.StaticCache``): the same prefill, copied once into a cache
preallocated for ``P + max_new_tokens`` positions, then every step runs all ``N`` rows on tensors
of fixed shape and address: the attention mask is built once for every position (the causal mask
comes from the cache's own length, so the future is hidden without growing a mask), a finished row
keeps running but writes ``pad_id``, and the host asks whether every row has finished only every
``check_every`` tokens. A step with no host sync and no new shape is what a GPU runs without
waiting on Python, and what ``torch.compile(mode="reduce-overhead")`` captures as a CUDA graph
(``compile_step``); where a launch costs more than the compute (a small batch on a large card),
that is the step's time.

EOS is suppressed for the first ``min_new_tokens`` tokens. Greedy decoding (temperature 0) gives
the same tokens as ``model.generate`` (tested). With ``row_seeds`` each completion draws its
uniform numbers from a generator of its own (``row_uniforms``), so a completion's tokens do not
depend on which other prompts share the call nor on the loop (a data-parallel rank samples its
share of a step exactly as one process samples the whole step, up to float rounding); without,
from the global torch generator, whose stream then depends on the loop (the dynamic loop draws for
live rows only).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from grpo.logprobs import position_ids_from_mask
from grpo.registry import Registry


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


@dataclass(frozen=True)
class Sampling:
    """What every step of a decode loop needs besides the model and the cache."""

    max_new_tokens: int
    eos: Tensor  # (E,) the ids that end a completion
    pad_id: int
    temperature: float
    top_p: float
    min_new_tokens: int
    uniforms: Tensor | None  # (N, max_new_tokens) per-completion uniform numbers, or None

    def next_tokens(self, logits: Tensor, t: int, rows: Tensor | None = None) -> Tensor:
        """(n,) step ``t``'s tokens from (n, V) logits; ``rows``: which completions the n rows are
        (``None``: all of them)."""
        if t < self.min_new_tokens:
            logits[:, self.eos] = float("-inf")
        u = None if self.uniforms is None else (self.uniforms[:, t] if rows is None else self.uniforms[rows, t])
        return sample_tokens(logits, self.temperature, self.top_p, uniforms=u)


DecodeLoop = Callable[..., Tensor]
DECODE_LOOPS: Registry[DecodeLoop] = Registry("decode loop", "decode loop", also=("auto",))
"""Loop name -> ``loop(model, ids, mask, num_samples, sampling, **options)``; ``auto``: ``static``
on CUDA, ``dynamic`` elsewhere (``resolve_loop``)."""


def resolve_loop(choice: str, device: torch.device | str) -> str:
    """The loop ``choice`` names; ``auto``: ``static`` on CUDA, ``dynamic`` elsewhere."""
    if DECODE_LOOPS.check(choice, "loop") in DECODE_LOOPS.also:
        return "static" if torch.device(device).type == "cuda" else "dynamic"
    return choice


@torch.no_grad()
def decode(model, ids: Tensor, mask: Tensor, num_samples: int, *, max_new_tokens: int, eos_ids: set[int],
           pad_id: int, temperature: float = 1.0, top_p: float = 1.0, min_new_tokens: int = 0,
           row_seeds: list[int] | None = None, loop: str = "auto", **options) -> Tensor:
    """Sample ``num_samples`` completions of each left-padded prompt.

    ids, mask: (B, P) distinct prompts. ``row_seeds``: B * num_samples seeds, one per completion
    (see the module docstring). ``loop``: a ``DECODE_LOOPS`` name or ``auto``; ``options``: that
    loop's own (``static``: ``check_every``, ``compile_step``). Returns (B * num_samples, C)
    completion tokens, C <= ``max_new_tokens``, completions of a prompt contiguous; after a row's
    EOS: ``pad_id``.
    """
    device = ids.device
    uniforms = None if row_seeds is None else row_uniforms(row_seeds, max_new_tokens).to(device)
    sampling = Sampling(max_new_tokens, torch.tensor(sorted(eos_ids), device=device), pad_id, temperature, top_p,
                        min_new_tokens, uniforms)
    return DECODE_LOOPS[resolve_loop(loop, device)](model, ids, mask, num_samples, sampling, **options)


def prefill(model, ids: Tensor, mask: Tensor, num_samples: int):
    """Each distinct prompt once: (its ``DynamicCache`` for the B prompts, (B * num_samples, V)
    fp32 logits of the first token, each prompt's row repeated for its completions)."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True,
                logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1].float().repeat_interleave(num_samples, 0)


@DECODE_LOOPS.register("dynamic")
def dynamic_loop(model, ids: Tensor, mask: Tensor, num_samples: int, s: Sampling) -> Tensor:
    """Finished rows leave the batch (module docstring); one host sync per token."""
    n, device = ids.shape[0] * num_samples, ids.device
    cache, logits = prefill(model, ids, mask, num_samples)  # logits (N, V)
    cache.batch_repeat_interleave(num_samples)
    attn = mask.repeat_interleave(num_samples, 0)  # (N, P + t)
    position = position_ids_from_mask(attn)[:, -1] + 1  # (N,) position of the next token
    tokens = torch.full((n, s.max_new_tokens), s.pad_id, dtype=torch.long, device=device)  # (N, max_new)
    live = torch.arange(n, device=device)  # rows of ``tokens`` still generating
    length = 0
    for t in range(s.max_new_tokens):
        nxt = s.next_tokens(logits, t, live)  # (n_live,)
        tokens[live, t] = nxt
        length = t + 1
        going = ~torch.isin(nxt, s.eos)
        if t == s.max_new_tokens - 1 or not going.any():
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


def static_cache(model, prompt_cache, num_samples: int, max_len: int):
    """A ``transformers.StaticCache`` of ``max_len`` positions holding ``prompt_cache`` (a
    ``DynamicCache`` of B prompts) repeated ``num_samples`` times per prompt; its length is the
    prompts'. A model with sliding-window layers is refused (``ValueError``)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    if any(layer.is_sliding for layer in cache.layers):
        raise ValueError("the static decode loop holds full-attention layers only; use the dynamic loop")
    for layer, src in zip(cache.layers, prompt_cache.layers, strict=True):
        keys = src.keys.repeat_interleave(num_samples, 0)  # (N, kv heads, P, d)
        values = src.values.repeat_interleave(num_samples, 0)
        layer.lazy_initialization(keys, values)
        layer.keys[:, :, : keys.shape[2]].copy_(keys)
        layer.values[:, :, : values.shape[2]].copy_(values)
        layer.cumulative_length.fill_(keys.shape[2])
    return cache


def static_step(model, cache, attn: Tensor, compile_step: bool) -> Callable[[Tensor, Tensor], Tensor]:
    """``step(tokens (N, 1), positions (N, 1)) -> (N, V)`` fp32 logits of the next token, on
    fixed-shape inputs; with ``compile_step``, compiled with ``mode="reduce-overhead"`` (a CUDA
    graph; its output is copied out before the next replay overwrites it)."""

    def step(tokens: Tensor, positions: Tensor) -> Tensor:
        out = model(input_ids=tokens, attention_mask=attn, position_ids=positions, past_key_values=cache,
                    use_cache=True)
        return out.logits[:, -1].float()

    if not compile_step:
        return step
    compiled = torch.compile(step, mode="reduce-overhead", dynamic=False)

    def replay(tokens: Tensor, positions: Tensor) -> Tensor:
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(tokens, positions).clone()

    return replay


@DECODE_LOOPS.register("static")
def static_loop(model, ids: Tensor, mask: Tensor, num_samples: int, s: Sampling, check_every: int = 16,
                compile_step: bool = False) -> Tensor:
    """Every row runs every step on fixed shapes; one host sync per ``check_every`` tokens (module
    docstring). Returns the tokens up to the last row's EOS, as the dynamic loop does."""
    (b, p), device = ids.shape, ids.device
    n = b * num_samples
    prompt_cache, logits = prefill(model, ids, mask, num_samples)  # logits (N, V)
    cache = static_cache(model, prompt_cache, num_samples, p + s.max_new_tokens)
    del prompt_cache
    attn = torch.cat([mask.repeat_interleave(num_samples, 0), mask.new_ones(n, s.max_new_tokens)], 1)  # (N, P + max_new)
    position = position_ids_from_mask(mask)[:, -1].repeat_interleave(num_samples)[:, None] + 1  # (N, 1)
    step = static_step(model, cache, attn, compile_step)
    tokens = torch.full((n, s.max_new_tokens), s.pad_id, dtype=torch.long, device=device)  # (N, max_new)
    ended = torch.full((n,), s.max_new_tokens, dtype=torch.long, device=device)  # (N,) tokens up to its EOS
    for t in range(s.max_new_tokens):
        done = ended <= t  # (N,) rows whose EOS came before step t
        nxt = s.next_tokens(logits, t).masked_fill(done, s.pad_id)  # (N,)
        tokens[:, t] = nxt
        ended = torch.where(~done & torch.isin(nxt, s.eos), t + 1, ended)
        if t == s.max_new_tokens - 1 or ((t + 1) % check_every == 0 and bool((ended <= t + 1).all())):
            break
        logits = step(nxt[:, None], position + t)  # (N, V)
    return tokens[:, : int(ended.max())]
