"""The decode loop's memory for one call, and the split of a call that does not fit.

``TransformersBackend`` (SENT, the evaluations and training without vLLM) holds, on top of the
weights, for a call of B prompts x G completions (N = B * G rows) of P prompt + C new tokens:

* the decode phase: the KV cache of every row (N x (P + C) positions), the prompts' own cache
  from the prefill while it is copied in (B x P), and six (N, V) fp32 tensors (the step's
  logits, their fp32 copy, the probabilities, the CDF, the EOS-masked copy, the prefill's
  logits);
* with log-probs, the teacher-forced pass after it, ``logprob_rows`` rows (whole groups) at a
  time: their KV cache (rows x (P + C)), one layer's MLP activations (three (rows, C, I) tensors)
  and four (rows, C, H) hidden-state tensors.

With the step compiled (``CompiledCall``) the call is padded to its step's shape
(``grpo.rollout.sampling.DecodeLoop.step_shape``: B' prompts of P' tokens, N' = B' G rows, L = P' + C positions) and
the step's buffers stay after it, for the next call: its ``StaticCache`` (N' x L), its int64 mask
(N', L) and its CUDA graph's pool (``graph_pool_bytes``). They count in both phases (the log-prob
pass runs beside them) when the call makes the step; a call on a step already held finds them
allocated (outside the budget) and counts none. The decode phase then holds the prompts' cache
(B' x P'), the larger of the six logits-sized tensors and the prefill's MLP activations (B' P'
tokens), and the (N', C) token buffers; the log-prob pass what the trace of it shows
(``logprob_pass_bytes``: the LM head's chunk of logits, not a KV cache, is its largest part). The
uncompiled loops keep the terms above, with which the H200's call was checked.

The larger of the two phases, times ``1 + ALLOWANCE``, is the call's prediction. ``ALLOWANCE`` covers
what the terms leave out (allocator rounding, the copies of one layer while the cache is filled):
docs/gpu-notes.md#sent-and-the-evaluations-on-an-8-gb-card gives the measurement it comes from.
On CUDA ``prompts_per_call`` splits a call into calls of fewer prompts until the prediction fits
``allocator_budget`` (the memory free now, under the allocator's per-process cap when one is set):
``split_call`` asks the decode loop whether its step is compiled, and a compiled call first takes
a step already held.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

from grpo.algorithm.logprobs import chunked_entropy_logprobs
from grpo.rollout.engine.bounds import kv_cache_bytes

ALLOWANCE = 0.10
"""The share added to a call's working bytes for what the terms leave out (module docstring)."""
LOGITS_COPIES = 6
"""(N, V) fp32 tensors alive at once in a decode step (module docstring)."""
LOGPROB_ROWS = 64
"""The teacher-forced log-prob pass's rows at a time (whole groups): ``TransformersBackend``'s."""
LOGPROB_CHUNK = inspect.signature(chunked_entropy_logprobs).parameters["chunk"].default
"""Tokens of the log-prob pass's LM-head chunk (``grpo.algorithm.logprobs.chunked_entropy_logprobs``' default)."""


@dataclass(frozen=True)
class Dims:
    """What a call's memory depends on in a model: layers, KV heads, head dim, hidden and
    intermediate sizes, vocabulary, and ``b`` bytes per weight/activation entry."""

    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    vocab: int
    b: int

    def kv(self, rows: int, positions: int) -> int:
        return kv_cache_bytes(self.layers, self.kv_heads, self.head_dim, rows, positions, self.b)


def model_dims(model) -> Dims:
    """``Dims`` of a loaded model (its text config; ``b`` from its input embeddings)."""
    cfg, head_dim, kv_heads, b = _shape(model)
    return Dims(cfg.num_hidden_layers, cfg.num_attention_heads, kv_heads, head_dim, cfg.hidden_size,
                getattr(cfg, "intermediate_size", 4 * cfg.hidden_size), cfg.vocab_size, b)


def shapes_dims(shapes, b: int) -> Dims:
    """``Dims`` of ``grpo.core.model_shapes.ModelShapes`` in ``b``-byte entries (``grpo check``)."""
    return Dims(shapes.layers, shapes.heads, shapes.kv_heads, shapes.head_dim, shapes.hidden, shapes.intermediate,
                shapes.vocab, b)


@dataclass(frozen=True)
class CompiledCall:
    """A call on a compiled step: padded to ``prompts`` x ``prompt_len`` (``grpo.rollout.sampling.call_shape``);
    ``new_step``: the call makes the step (its buffers count), else it runs on one already held."""

    prompts: int
    prompt_len: int
    new_step: bool = True


def graph_pool_bytes(d: Dims, rows: int, positions: int) -> int:
    """What a compiled step's CUDA graph keeps in its private pool (the step's transient tensors,
    replayed at fixed addresses): one layer's keys and values repeated to every attention head for
    SDPA (``2 a d b`` per position and row: the largest, traced), the (N, V) logits in ``b`` and
    their fp32 copy, and one layer's MLP and hidden-state tensors of the N tokens."""
    return (2 * rows * d.heads * positions * d.head_dim * d.b + rows * d.vocab * (d.b + 4)
            + rows * (3 * d.intermediate + 4 * d.hidden) * d.b)


def compiled_step_bytes(d: Dims, rows: int, positions: int) -> int:
    """A compiled step's buffers that stay between calls: ``StaticCache``, int64 mask, graph pool."""
    return d.kv(rows, positions) + rows * positions * 8 + graph_pool_bytes(d, rows, positions)


def logprob_pass_bytes(d: Dims, rows: int, prompt_len: int, new_tokens: int) -> int:
    """The teacher-forced log-prob pass of ``rows`` sequences as traced (``bench/cuda_memory.py
    --all``): four (rows, C, H) hidden-state tensors, then the larger of one layer's MLP over the
    rows' ``P + C`` tokens (``3 I + 2 H`` entries a token) and the LM head's chunk
    (``LOGPROB_CHUNK`` tokens x V: the logits in ``b``, an fp32 copy, its shifted values and
    their exponentials)."""
    body = rows * (prompt_len + new_tokens) * (3 * d.intermediate + 2 * d.hidden) * d.b
    head = min(LOGPROB_CHUNK, rows * new_tokens) * d.vocab * (d.b + 12)
    return 4 * rows * new_tokens * d.hidden * d.b + max(body, head)


def _shape(model):
    cfg = model.config.get_text_config(decoder=True)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
    b = model.get_input_embeddings().weight.element_size()
    return cfg, head_dim, kv_heads, b


def decode_working_bytes(model, rows: int, positions: int) -> int:
    """The decode loop's KV cache for ``rows`` completions of ``positions`` tokens (layers x 2 x KV
    heads x head dim x positions x rows, in the weights' dtype) and four (rows, V) fp32 tensors: the
    working memory ``dense_decode`` weighs against the dense copies."""
    cfg, head_dim, kv_heads, b = _shape(model)
    return kv_cache_bytes(cfg.num_hidden_layers, kv_heads, head_dim, rows, positions, b) + 4 * rows * cfg.vocab_size * 4


def sampler_call_bytes(model, prompts: int, samples: int, prompt_len: int, new_tokens: int,
                       logprob_rows: int | None = None, compiled: CompiledCall | None = None) -> int:
    """A call's working bytes above the weights (module docstring), ``ALLOWANCE`` included;
    ``logprob_rows``: the teacher-forced pass's rows at a time (``None``: no log-probs);
    ``compiled``: the call on a compiled step (``None``: the uncompiled loops)."""
    return call_bytes(model_dims(model), prompts, samples, prompt_len, new_tokens, logprob_rows, compiled)


def call_bytes(d: Dims, prompts: int, samples: int, prompt_len: int, new_tokens: int,
               logprob_rows: int | None = None, compiled: CompiledCall | None = None) -> int:
    """``sampler_call_bytes`` from a model's ``Dims``."""
    rows, positions = prompts * samples, prompt_len + new_tokens
    kept = 0
    if compiled is None:
        decoding = d.kv(rows, positions) + d.kv(prompts, prompt_len) + LOGITS_COPIES * rows * d.vocab * 4
    else:
        b_, p_ = compiled.prompts, compiled.prompt_len
        n_ = b_ * samples
        kept = compiled_step_bytes(d, n_, p_ + new_tokens) if compiled.new_step else 0
        prefill = b_ * p_ * (3 * d.intermediate + 4 * d.hidden) * d.b
        decoding = kept + d.kv(b_, p_) + max(LOGITS_COPIES * n_ * d.vocab * 4, prefill) + 2 * n_ * new_tokens * 8
    scoring = 0
    if logprob_rows and compiled is not None:
        scoring = kept + logprob_pass_bytes(d, min(rows, logprob_rows), prompt_len, new_tokens)
    elif logprob_rows:
        r = min(rows, logprob_rows)
        scoring = d.kv(r, positions) + r * new_tokens * (3 * d.intermediate + 4 * d.hidden) * d.b
    return int(max(decoding, scoring) * (1 + ALLOWANCE))


def allocator_budget(device: torch.device) -> int | None:
    """Bytes a call may still allocate on ``device``: CUDA's free memory plus what the allocator
    holds unused, no more than its per-process cap (``torch.cuda.set_per_process_memory_fraction``)
    leaves; ``None`` off CUDA (no split there)."""
    if device.type != "cuda":
        return None
    free, total = torch.cuda.mem_get_info(device)
    reserved, allocated = torch.cuda.memory_reserved(device), torch.cuda.memory_allocated(device)
    fraction = getattr(torch.cuda, "get_per_process_memory_fraction", lambda _d=None: 1.0)(device)
    return min(free + reserved - allocated, int(fraction * total) - allocated)


def prompts_per_call(model, prompts: int, samples: int, prompt_len: int, new_tokens: int, budget: int | None,
                     logprob_rows: int | None = None) -> int:
    """The most of ``prompts`` one call takes so that ``sampler_call_bytes`` fits ``budget`` (all of
    them where ``budget`` is ``None``; at least one, which may not fit: the caller says so)."""
    if budget is None:
        return prompts
    for n in range(prompts, 0, -1):
        if sampler_call_bytes(model, n, samples, prompt_len, new_tokens, logprob_rows) <= budget:
            return n
    return 1


@dataclass(frozen=True)
class CallSize:
    """A decode call's size: ``prompts`` x ``samples`` completions of ``prompt_len`` prompt +
    ``new_tokens`` new tokens."""

    prompts: int
    samples: int
    prompt_len: int
    new_tokens: int


def split_call(d: Dims, call: CallSize, budget: int | None, logprob_rows: int | None, loop,
               held=()) -> tuple[int, CompiledCall | None]:
    """The split of ``call`` on the decode loop ``loop`` (a built ``grpo.rollout.sampling.DecodeLoop``,
    asked whether its step is ``compiled``): (prompts a call takes, its ``CompiledCall``, ``None``
    for an uncompiled loop), the most prompts whose ``call_bytes`` fit ``budget`` (all of them
    where ``budget`` is ``None``; a call that would not fit even alone takes one prompt: the caller
    says so). A compiled call first takes the most prompts that run on one of the ``held`` steps
    ((rows, positions), ``DecodeLoop.step_shape``) within ``budget``, then the most that fit
    with a new step."""
    samples, prompt_len, new_tokens = call.samples, call.prompt_len, call.new_tokens

    def fits(n: int, compiled: CompiledCall | None) -> bool:
        return budget is None or call_bytes(d, n, samples, prompt_len, new_tokens, logprob_rows, compiled) <= budget

    if not loop.compiled:
        return next((n for n in range(call.prompts, 0, -1) if fits(n, None)), 1), None

    def shape(n: int) -> CompiledCall:
        p, length = loop.step_shape(n, samples, prompt_len, new_tokens, held)
        return CompiledCall(p, length, (p * samples, length + new_tokens) not in set(held))

    if budget is None:
        return call.prompts, shape(call.prompts)
    for reuse in (True, False):
        for n in range(call.prompts, 0, -1):
            c = shape(n)
            if c.new_step != reuse and fits(n, c):
                return n, c
    return 1, shape(1)
