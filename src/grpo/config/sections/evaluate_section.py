"""The ``evaluate`` section: the baseline and final evaluations on the test split."""

from __future__ import annotations

from typing import ClassVar

from grpo.config.choices import Choice
from grpo.config.sections.engine import VLLMEngineConfig
from grpo.core.fields import Positive


class EvaluateConfig(VLLMEngineConfig):
    SECTION: ClassVar[str] = "evaluate"
    test_path: str = "data/raw/test.jsonl"
    """Split to evaluate (baseline and final use the same one)."""
    backend: Choice("evaluate.backend") = "auto"
    """``vllm``, ``transformers``, or ``auto`` (vLLM when installed)."""
    max_new_tokens: Positive = 64
    """Length cap of each greedy completion."""
    batch_prompts: Positive = 64
    """Prompts per generation call."""
