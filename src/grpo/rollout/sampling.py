"""Autoregressive sampling with a KV cache: the decode loop of ``TransformersBackend``.

``decode`` replaces ``model.generate`` and has two loops (``DECODE_LOOPS``: each a ``DecodeLoop``
class that ``plan_decode`` builds once from its own options, ``decode.loop_options.<name>``, and the
``decode`` section, and that its callers ask what it holds instead of its name;
docs/howto/add-a-decode-loop.md), which give the same tokens for the same ``row_seeds`` (tested for
every registered loop):

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
``check_every`` tokens (``decode.loop_options.static``). A step with no host sync and no new shape is what a GPU runs without
waiting on Python, and what ``torch.compile(mode="reduce-overhead")`` captures as a CUDA graph
(``StaticLoop(compile_step=True)``); where a launch costs more than the compute (a small batch on a large card),
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

import logging
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import ClassVar

import torch
from torch import Tensor

from grpo.algorithm.logprobs import position_ids_from_mask
from grpo.core.fields import Positive, Section
from grpo.core.registry import Registry

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class Draw:
    """How a decode call draws each completion: at most ``max_new_tokens`` tokens, ended by any of
    ``eos_ids`` (``pad_id`` after it), at ``temperature`` (0: greedy) within the top-p nucleus, no
    EOS before ``min_new_tokens``; ``row_seeds``: one seed per completion (module docstring), or
    ``None`` (the global torch generator)."""

    max_new_tokens: int
    eos_ids: set[int] | frozenset[int]
    pad_id: int
    temperature: float = 1.0
    top_p: float = 1.0
    min_new_tokens: int = 0
    row_seeds: list[int] | None = None


class DecodeLoop:
    """A decode loop, registered by name in ``DECODE_LOOPS`` and built once from its own options
    (``Options``, a ``grpo.core.fields.Section`` under ``decode.loop_options.<name>``; ``None``: a
    loop without options) by ``plan`` (``plan_decode`` hands it those options and the ``decode``
    section; a bench or a test builds one directly), then called for every decode call:
    ``loop(model, ids, mask, num_samples, sampling) -> (N, C)`` tokens.

    What the callers ask it instead of its name (``plan_decode``, ``grpo.rollout.rollout_backends``,
    ``grpo.rollout.decode_memory.split_call``, ``grpo.tools.memory``):

    * ``suits(device)`` (a class method): whether ``decode.loop: auto`` picks it on ``device``
      (the first registered loop that suits);
    * ``compiles`` (of the class): whether it can compile its step; ``decode.compile_step: on``
      needs a loop that can, and picks the first that can under ``loop: auto``;
    * ``compiled``: whether this loop's step is compiled. Its calls are then padded to the step's
      shape (``step_shape``), the step's buffers stay between calls, and so do the dense copies of
      the 4-bit layers it reads; the memory estimate counts them (``grpo.rollout.decode_memory``). An
      uncompiled loop holds nothing after a call, and its memory is the uncompiled terms'.
    """

    Options: ClassVar[type[Section] | None] = None
    """The loop's options model (``None``: a loop without options)."""
    compiles: ClassVar[bool] = False
    compiled: bool = False

    @classmethod
    def suits(cls, device: torch.device | str) -> bool:
        """Whether ``decode.loop: auto`` picks this loop on ``device``."""
        return False

    @classmethod
    def plan(cls, cfg, options: Section | None, device: torch.device | str, planned_tokens: int | None) -> DecodePlan:
        """This loop built from its ``options`` (``decode.loop_options.<name>``, an ``Options``; ``None``
        for a loop that declares none) and the ``decode`` section ``cfg`` for ``device`` and the
        stage's ``planned_tokens``, and why, in words."""
        raise NotImplementedError

    def step_shape(self, prompts: int, samples: int, prompt_len: int, new_tokens: int,
                   held=()) -> tuple[int, int]:
        """(prompts, prompt length) a call of ``prompts`` x ``samples`` completions of ``prompt_len``
        + ``new_tokens`` tokens runs as, given the ``held`` steps' (rows, positions): as it is for
        an uncompiled loop."""
        return prompts, prompt_len

    def __call__(self, model, ids: Tensor, mask: Tensor, num_samples: int, s: Sampling) -> Tensor:
        raise NotImplementedError


DECODE_LOOPS: Registry[type[DecodeLoop]] = Registry("decode loop", "decode loop", also=("auto",))
"""Loop name -> its ``DecodeLoop`` class; ``auto``: the first registered loop that ``suits`` the
device (static on CUDA, dynamic elsewhere: ``resolve_loop``). ``plan_decode`` is where a name
becomes a loop."""


def resolve_loop(choice: str, device: torch.device | str) -> str:
    """The loop ``choice`` names; ``auto``: the first registered loop that ``suits`` ``device``
    (static on CUDA, dynamic elsewhere)."""
    if DECODE_LOOPS.check(choice, "loop") in DECODE_LOOPS.also:
        return next(name for name, entry in DECODE_LOOPS.items() if entry.suits(device))
    return choice


@dataclass(frozen=True)
class DecodePlan:
    """What ``plan_decode`` chose: the loop, built (``decode(..., loop)``), and why, in words
    (logged once, and printed by ``grpo check``)."""

    loop: DecodeLoop
    why: str


def plan_decode(cfg, device: torch.device | str, planned_tokens: int | None = None) -> DecodePlan:
    """The decode loop of the ``decode`` section ``cfg`` (``grpo.config.sections.decode.DecodeConfig``),
    built: ``loop: auto`` is the first registered loop that ``suits`` the device, static on CUDA,
    dynamic elsewhere (``compile_step: on`` makes it the first registered loop that ``compiles``,
    anywhere); the entry builds itself from its options (``decode.loop_options.<name>``) and ``cfg``
    (``DecodeLoop.plan``: the static loop compiles its step under ``compile_step: auto`` on CUDA
    when ``planned_tokens``, the token steps the stage will decode, ``None``: unknown, taken as
    enough, reach ``cfg.compile_min_tokens``). ``compile_step: on`` with a loop that cannot compile
    is a ``ValueError`` naming ``decode.compile_step``."""
    name = resolve_loop(cfg.loop, device)
    compiling = [n for n, entry in DECODE_LOOPS.items() if entry.compiles]
    if cfg.compile_step == "on" and cfg.loop in DECODE_LOOPS.also and compiling:
        name = compiling[0]
    entry = DECODE_LOOPS[name]
    if cfg.compile_step == "on" and not entry.compiles:
        loops = " or ".join(compiling)
        raise ValueError(f"decode.compile_step: on needs the {loops} loop; set decode.loop: {loops} or auto")
    return entry.plan(cfg, cfg.loop_options.get(name), device, planned_tokens)


@torch.no_grad()
def decode(model, ids: Tensor, mask: Tensor, num_samples: int, draw: Draw, loop: DecodeLoop) -> Tensor:
    """Sample ``num_samples`` completions of each left-padded prompt with ``loop`` (a built
    ``DecodeLoop``: ``plan_decode``'s, or one a caller made).

    ids, mask: (B, P) distinct prompts; ``draw``: how each completion is drawn (``row_seeds``: B *
    num_samples seeds, one per completion; see the module docstring). Returns (B * num_samples, C)
    completion tokens, C <= ``draw.max_new_tokens``, completions of a prompt contiguous; after a
    row's EOS: ``pad_id``.
    """
    device = ids.device
    uniforms = None if draw.row_seeds is None else row_uniforms(draw.row_seeds, draw.max_new_tokens).to(device)
    sampling = Sampling(draw.max_new_tokens, torch.tensor(sorted(draw.eos_ids), device=device), draw.pad_id,
                        draw.temperature, draw.top_p, draw.min_new_tokens, uniforms)
    return loop(model, ids, mask, num_samples, sampling)


def prefill(model, ids: Tensor, mask: Tensor, num_samples: int):
    """Each distinct prompt once: (its ``DynamicCache`` for the B prompts, (B * num_samples, V)
    fp32 logits of the first token, each prompt's row repeated for its completions)."""
    out = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask), use_cache=True,
                logits_to_keep=1)
    return out.past_key_values, out.logits[:, -1].float().repeat_interleave(num_samples, 0)


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


@DECODE_LOOPS.register("dynamic")
class DynamicLoop(DecodeLoop):
    """``dynamic_loop``: finished rows leave the batch; no options, nothing compiled. ``auto``'s
    loop off CUDA, where the rows that leave are compute saved."""

    @classmethod
    def suits(cls, device: torch.device | str) -> bool:
        return torch.device(device).type != "cuda"

    @classmethod
    def plan(cls, cfg, options: None, device: torch.device | str, planned_tokens: int | None) -> DecodePlan:
        auto = " (decode.loop: auto on a CPU)" if cfg.loop == "auto" else ""
        return DecodePlan(cls(), f"dynamic: finished rows leave the batch{auto}")

    def __call__(self, model, ids: Tensor, mask: Tensor, num_samples: int, s: Sampling) -> Tensor:
        return dynamic_loop(model, ids, mask, num_samples, s)


def static_cache(model, prompt_cache, num_samples: int, max_len: int):
    """A new ``transformers.StaticCache`` of ``max_len`` positions holding ``prompt_cache`` (a
    ``DynamicCache`` of B prompts) repeated ``num_samples`` times per prompt; its length is the
    prompts'. A model with sliding-window layers is refused (``ValueError``)."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=max_len)
    fill_static_cache(cache, prompt_cache, num_samples)
    return cache


def static_step(model, cache, attn: Tensor) -> Callable[[Tensor, Tensor], Tensor]:
    """``step(tokens (N, 1), positions (N, 1)) -> (N, V)`` fp32 logits of the next token, on
    fixed-shape inputs, the KV cache ``cache`` and the attention mask ``attn`` (N, L) held by it."""

    def step(tokens: Tensor, positions: Tensor) -> Tensor:
        out = model(input_ids=tokens, attention_mask=attn, position_ids=positions, past_key_values=cache,
                    use_cache=True)
        return out.logits[:, -1].float()

    return step


@dataclass
class CompiledStep:
    """One compiled decode step and the buffers it was compiled on: a ``StaticCache`` and an
    attention mask of fixed shape (N, L), refilled by every call (their addresses are what a CUDA
    graph replays), and the seconds its first call took (compilation and capture)."""

    cache: object
    attn: Tensor  # (N, L)
    run: Callable[[Tensor, Tensor], Tensor]
    first_call_s: float | None = None


_COMPILED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""model -> {(N, L): CompiledStep}: a shape is compiled once per process and model."""


def compiled_steps(model) -> dict:
    """The compiled steps this process holds for ``model``, by (rows, positions)."""
    return _COMPILED.setdefault(model, {})


def release_compiled_steps(model) -> int:
    """Drop every compiled step this process holds for ``model`` (their ``StaticCache``, mask and
    compiled function: the memory is the allocator's again once nothing else refers to them);
    returns how many. The next compiled call of ``model`` compiles again."""
    return len(_COMPILED.pop(model, {}))


def compiled_step(model, rows: int, max_len: int, device: torch.device) -> CompiledStep:
    """The compiled step for ``rows`` x ``max_len`` positions of ``model``, made on its first use:
    ``torch.compile`` with ``mode="reduce-overhead"`` on CUDA (the step captured as a CUDA graph;
    its output is copied out before the next replay overwrites it), the default mode elsewhere.
    A new step drops the steps of as many rows and fewer positions, which it serves instead
    (``call_shape``): one step per row count is held. The CUDA path follows the pinned libraries'
    code, not a run (docs/gpu-notes.md, "The `decode` section")."""
    steps, key = compiled_steps(model), (rows, max_len)
    if key not in steps:
        from transformers import StaticCache

        for held in [k for k in steps if k[0] == rows and k[1] < max_len]:
            del steps[held]  # before the new cache is allocated: the two are never held together
        cache = StaticCache(config=model.config, max_cache_len=max_len)
        attn = torch.ones(rows, max_len, dtype=torch.long, device=device)  # (N, L)
        mode = "reduce-overhead" if device.type == "cuda" else "default"
        compiled = torch.compile(static_step(model, cache, attn), mode=mode, dynamic=False)

        def run(tokens: Tensor, positions: Tensor) -> Tensor:
            if device.type == "cuda":
                torch.compiler.cudagraph_mark_step_begin()
            return compiled(tokens, positions).clone()

        steps[key] = CompiledStep(cache, attn, run)
    return steps[key]


def call_shape(prompts: int, samples: int, prompt_len: int, new_tokens: int, length_bucket: int,
               held=()) -> tuple[int, int]:
    """(prompts, prompt length) a compiled call of ``prompts`` x ``samples`` completions of
    ``prompt_len`` + ``new_tokens`` tokens is padded to: the smallest of the ``held`` steps' shapes
    ((rows, positions) keys of ``compiled_steps``) with whole groups of ``samples`` for at least
    ``prompts`` prompts and room for the prompt, so that the call runs on a step already compiled
    (no compilation, no new cache); else the next power of two of ``prompts`` and ``prompt_len``
    rounded up to a multiple of ``length_bucket`` (a new step)."""
    fits = sorted((rows, positions) for rows, positions in held
                  if rows % samples == 0 and rows // samples >= prompts and positions - new_tokens >= prompt_len)
    if fits:
        rows, positions = fits[0]
        return rows // samples, positions - new_tokens
    return 1 << (prompts - 1).bit_length(), bucket_up(prompt_len, length_bucket)


def compiled_call_shape(model, prompts: int, samples: int, prompt_len: int, new_tokens: int,
                        length_bucket: int) -> tuple[int, int]:
    """``call_shape`` against the steps this process holds for ``model``."""
    return call_shape(prompts, samples, prompt_len, new_tokens, length_bucket, compiled_steps(model))


def bucket_up(value: int, bucket: int) -> int:
    """``value`` rounded up to a multiple of ``bucket``."""
    return -(-value // bucket) * bucket


def bucketed_call(ids: Tensor, mask: Tensor, s: Sampling, num_samples: int, length_bucket: int,
                  shape: tuple[int, int] | None = None) -> tuple[Tensor, Tensor, Sampling]:
    """The call padded to a compiled step's shape: ``shape`` (prompts, prompt length; default
    ``call_shape`` without held steps: prompts left-padded (mask 0) to a multiple of
    ``length_bucket`` tokens, the B prompts to the next power of two), the added prompts repeating
    the last one, their completions drawing the last completions' uniform numbers (they sample
    what those do and end when they end; the caller drops them). Calls of one shape share one
    compilation: a compiled step recompiles for every new shape."""
    (b, p) = ids.shape
    to_b, to_p = shape or call_shape(b, num_samples, p, 0, length_bucket)
    pad_p, pad_b = to_p - p, to_b - b
    if pad_p:
        ids = torch.cat([ids.new_zeros(b, pad_p), ids], 1)  # (B, P'): masked, any id will do
        mask = torch.cat([mask.new_zeros(b, pad_p), mask], 1)
    if pad_b:
        ids = torch.cat([ids, ids[-1:].expand(pad_b, -1)])  # (B', P')
        mask = torch.cat([mask, mask[-1:].expand(pad_b, -1)])
        if s.uniforms is not None:
            last = s.uniforms[-num_samples:].repeat(pad_b, 1)  # (pad_b * G, max_new)
            s = replace(s, uniforms=torch.cat([s.uniforms, last]))
    return ids, mask, s


def fill_static_cache(cache, prompt_cache, num_samples: int) -> None:
    """Write ``prompt_cache`` (a ``DynamicCache`` of B prompts) into ``cache`` (a ``StaticCache``),
    each prompt repeated ``num_samples`` times, and set its length to the prompts'. Positions past
    them may hold an earlier call's keys: the causal mask hides them until this call writes them."""
    if any(layer.is_sliding for layer in cache.layers):
        raise ValueError("the static decode loop holds full-attention layers only; use the dynamic loop")
    for layer, src in zip(cache.layers, prompt_cache.layers, strict=True):
        keys = src.keys.repeat_interleave(num_samples, 0)  # (N, kv heads, P, d)
        values = src.values.repeat_interleave(num_samples, 0)
        if not layer.is_initialized:
            layer.lazy_initialization(keys, values)
        layer.keys[:, :, : keys.shape[2]].copy_(keys)
        layer.values[:, :, : values.shape[2]].copy_(values)
        layer.cumulative_length.fill_(keys.shape[2])


@DECODE_LOOPS.register("static")
class StaticLoop(DecodeLoop):
    """``static_loop`` with its ``Options`` (``decode.loop_options.static``); it can compile its step
    (``compiles``; ``compile_step``: whether it does, ``decode.compile_step`` resolved by ``plan``).
    ``auto``'s loop on CUDA."""

    class Options(Section):
        SECTION: ClassVar[str] = "decode.loop_options.static"
        check_every: Positive = 16
        """The static loop asks whether every row has ended every this many tokens (one host sync)."""
        length_bucket: Positive = 64
        """A compiled step's prompts are left-padded to a multiple of this many tokens (and a call's
        prompts to a power of two), so that calls of one bucket share one compilation."""

    compiles: ClassVar[bool] = True

    def __init__(self, options: StaticLoop.Options | None = None, *, compile_step: bool = False):
        """``options``: an ``Options`` (``None``: its defaults); ``compile_step``: the step compiled."""
        self.options = options or self.Options()
        self.compiled = compile_step

    @classmethod
    def suits(cls, device: torch.device | str) -> bool:
        return torch.device(device).type == "cuda"

    @classmethod
    def plan(cls, cfg, options: StaticLoop.Options | None, device: torch.device | str,
             planned_tokens: int | None) -> DecodePlan:
        """``compile_step: auto`` compiles on CUDA when ``planned_tokens`` (``None``: unknown, taken
        as enough) reaches ``cfg.compile_min_tokens``; ``on``/``off`` as they say."""
        planned = "unknown" if planned_tokens is None else str(planned_tokens)
        if cfg.compile_step == "auto":
            cuda = torch.device(device).type == "cuda"
            enough = planned_tokens is None or planned_tokens >= cfg.compile_min_tokens
            compiled = cuda and enough
            reason = ("not on CUDA" if not cuda else
                      f"{planned} planned token steps {'>=' if enough else '<'} decode.compile_min_tokens "
                      f"{cfg.compile_min_tokens}")
            why = f"static, step {'compiled' if compiled else 'not compiled'} (decode.compile_step: auto, {reason})"
        else:
            compiled = cfg.compile_step == "on"
            why = f"static, step {'compiled' if compiled else 'not compiled'} (decode.compile_step: {cfg.compile_step})"
        return DecodePlan(cls(options, compile_step=compiled), why)

    def step_shape(self, prompts: int, samples: int, prompt_len: int, new_tokens: int,
                   held=()) -> tuple[int, int]:
        """Compiled: ``call_shape`` with this loop's ``length_bucket``; else as it is."""
        if not self.compiled:
            return prompts, prompt_len
        return call_shape(prompts, samples, prompt_len, new_tokens, self.options.length_bucket, held)

    def __call__(self, model, ids: Tensor, mask: Tensor, num_samples: int, s: Sampling) -> Tensor:
        return static_loop(model, ids, mask, num_samples, s, self.options, self.compiled)


def static_loop(model, ids: Tensor, mask: Tensor, num_samples: int, s: Sampling, options: StaticLoop.Options,
                compile_step: bool = False) -> Tensor:
    """Every row runs every step on fixed shapes; one host sync per ``options.check_every`` tokens
    (module docstring). With ``compile_step`` the step is compiled once per shape
    (``call_shape``: a step already held for as many rows or more, else a new bucket;
    ``bucketed_call``, ``compiled_step``; ``options.length_bucket``: the prompt lengths' bucket).
    Returns the tokens up to the last row's EOS, as the dynamic loop does."""
    check_every, length_bucket = options.check_every, options.length_bucket
    n_real = ids.shape[0] * num_samples
    if compile_step:
        shape = compiled_call_shape(model, ids.shape[0], num_samples, ids.shape[1], s.max_new_tokens, length_bucket)
        ids, mask, s = bucketed_call(ids, mask, s, num_samples, length_bucket, shape)
    (b, p), device = ids.shape, ids.device
    n = b * num_samples
    prompt_cache, logits = prefill(model, ids, mask, num_samples)  # logits (N, V)
    attn = torch.cat([mask.repeat_interleave(num_samples, 0), mask.new_ones(n, s.max_new_tokens)], 1)  # (N, P + max_new)
    if compile_step:
        state = compiled_step(model, n, p + s.max_new_tokens, device)
        fill_static_cache(state.cache, prompt_cache, num_samples)
        state.attn.copy_(attn)
        step = timed_first_call(state, n, p + s.max_new_tokens)
    else:
        step = static_step(model, static_cache(model, prompt_cache, num_samples, p + s.max_new_tokens), attn)
    del prompt_cache
    position = position_ids_from_mask(mask)[:, -1].repeat_interleave(num_samples)[:, None] + 1  # (N, 1)
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
    return tokens[:n_real, : int(ended[:n_real].max())]


def timed_first_call(state: CompiledStep, rows: int, positions: int) -> Callable[[Tensor, Tensor], Tensor]:
    """``state.run``, its first call in this process timed and logged once (the compilation's cost)."""
    if state.first_call_s is not None:
        return state.run

    def first(tokens: Tensor, positions_: Tensor) -> Tensor:
        if state.first_call_s is not None:
            return state.run(tokens, positions_)
        t0 = time.perf_counter()
        out = state.run(tokens, positions_)
        state.first_call_s = time.perf_counter() - t0
        log.info("decode: compiled the step for %d rows x %d positions in %.1f s (once per process and shape)",
                 rows, positions, state.first_call_s)
        return out

    return first
