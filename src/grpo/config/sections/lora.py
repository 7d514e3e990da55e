"""The ``lora`` section: the adapter the train stage attaches (peft)."""

from __future__ import annotations

from typing import Annotated, ClassVar

from pydantic import Field

from grpo.core.fields import Positive, PositiveFloat, Section


class LoraConfig(Section):
    SECTION: ClassVar[str] = "lora"
    rank: Positive = 16
    """LoRA rank r."""
    alpha: PositiveFloat = 32.0
    """LoRA scaling numerator: the update is ``(alpha / r) * B A x``."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the LoRA input."""
    target_modules: Annotated[list[str], Field(min_length=1)] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Leaf module names that get an adapter; each must exist in the model."""
