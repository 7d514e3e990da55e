"""The ``sent`` section: the SENT stage's sampling and its semantic-entropy estimate."""

from __future__ import annotations

from typing import ClassVar, Literal

from grpo.config.choices import Choice
from grpo.config.sections.engine import VLLMEngineConfig
from grpo.core.fields import Dtype, Fraction, Positive, PositiveFloat


class SentConfig(VLLMEngineConfig):
    SECTION: ClassVar[str] = "sent"
    data_path: str = "data/raw/train.jsonl"
    """Training problems to score."""
    out_path: str = "data/cache/train_sorted.jsonl"
    """The training set sorted by semantic entropy, ascending (easy -> hard)."""
    backend: Choice("sent.backend") = "auto"
    """``vllm``, ``transformers`` (the slower fallback), or ``auto`` (vLLM when installed, else transformers)."""
    num_samples: Positive = 8
    """M: answers sampled per prompt."""
    max_new_tokens: Positive = 32
    """Length cap of each sampled answer."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature (SENT samples at 1.0)."""
    top_p: Fraction = 1.0
    """Nucleus sampling mass."""
    estimator: Literal["likelihood", "count"] = "likelihood"
    """``likelihood``: cluster probability from length-normalised sequence likelihoods;
    ``count``: from cluster frequencies."""
    seed: int = 0
    """Sampling seed (vLLM: the engine seed)."""
    batch_prompts: Positive = 64
    """Prompts per generation call (each yields ``num_samples`` sequences)."""
    dtype: Dtype = "auto"
    """Generation dtype: ``auto`` (``grpo.core.device.sampling_dtype``: on CUDA as ``model.dtype``'s
    ``auto``, bf16 on CPUs with native bf16 instructions, fp32 on other CPUs), ``bfloat16``,
    ``float16`` or ``float32``."""
    enforce_eager: bool = True
    """vLLM: skip graph capture/compilation (a much faster engine start on a CPU, same speed)."""
