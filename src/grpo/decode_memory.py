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

The larger of the two, times ``1 + ALLOWANCE``, is the call's prediction. ``ALLOWANCE`` covers
what the terms leave out (allocator rounding, the copies of one layer while the cache is filled):
docs/gpu-notes.md#sent-and-the-evaluations-on-an-8-gb-card gives the measurement it comes from.
On CUDA ``prompts_per_call`` splits a call into calls of fewer prompts until the prediction fits
``allocator_budget`` (the memory free now, under the allocator's per-process cap when one is set).
"""

from __future__ import annotations

import torch

from grpo.engine.bounds import kv_cache_bytes

ALLOWANCE = 0.10
"""The share added to a call's working bytes for what the terms leave out (module docstring)."""
LOGITS_COPIES = 6
"""(N, V) fp32 tensors alive at once in a decode step (module docstring)."""


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
                       logprob_rows: int | None = None) -> int:
    """A call's working bytes above the weights (module docstring), ``ALLOWANCE`` included;
    ``logprob_rows``: the teacher-forced pass's rows at a time (``None``: no log-probs)."""
    cfg, head_dim, kv_heads, b = _shape(model)
    rows, positions = prompts * samples, prompt_len + new_tokens

    def kv(n: int, length: int) -> int:
        return kv_cache_bytes(cfg.num_hidden_layers, kv_heads, head_dim, n, length, b)

    decoding = kv(rows, positions) + kv(prompts, prompt_len) + LOGITS_COPIES * rows * cfg.vocab_size * 4
    scoring = 0
    if logprob_rows:
        r = min(rows, logprob_rows)
        inter = getattr(cfg, "intermediate_size", 4 * cfg.hidden_size)
        scoring = kv(r, positions) + r * new_tokens * (3 * inter + 4 * cfg.hidden_size) * b
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
