"""The ``data`` section: which problems ``prepare_data`` writes and how they are split."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from grpo.core.fields import NonNegative, Positive, PositiveFloat, Section


class DataConfig(Section):
    SECTION: ClassVar[str] = "data"
    source: Literal["gsm8k", "gsm_symbolic", "arithmetic", "jsonl"] = "arithmetic"
    """``gsm8k`` (``openai/gsm8k`` from the hub; needs internet), ``gsm_symbolic`` (reasoning-gym
    GSM8K-style word problems, offline), ``arithmetic`` (``grpo.data.arithmetic``: flat expressions in a few
    phrasings, labels computed and checked by the project, offline) or ``jsonl`` (your own file, see ``path``)."""
    path: str = ""
    """``jsonl`` source: file with one ``{"question", "answer"}`` object a line (``id``, ``solution`` optional);
    ``test_size`` rows (seeded) become the test split, at most ``train_size`` of the rest the train split."""
    difficulty: PositiveFloat = 1.0
    """``gsm_symbolic`` difficulty (reasoning-gym's scale of number sizes)."""
    out_dir: str = "data/raw"
    """Where ``train.jsonl`` and ``test.jsonl`` are written."""
    seed: int = 0
    """Generator seed: of the problems drawn and of the hash that gives each operand set (arithmetic)
    or template (gsm_symbolic) to one split (``grpo.data.sources.split_of``)."""
    train_size: Positive = 160
    """Training problems generated (duplicates are dropped)."""
    test_size: Positive = 500
    """Test problems: at most this many (fewer where the operand sets or templates run out)."""
    val_size: NonNegative = 200
    """Validation problems (for evaluation during training), held out like test; 0 writes an empty
    validation split."""
    min_terms: Positive = 2
    """Fewest operands per arithmetic problem."""
    max_terms: Positive = 2
    """Most operands per arithmetic problem."""
    min_digits: Positive = 1
    """Fewest digits per operand."""
    max_digits: Positive = 2
    """Most digits per operand (each operand draws its digit count, then its value)."""
    operators: list[Literal["+", "-", "*", "/"]] = Field(default_factory=lambda: ["+"])
    """Operators drawn from ``+ - * /`` (``grpo.data.arithmetic``: the usual precedence; ``/`` only where
    the quotient is an integer)."""

    @model_validator(mode="after")
    def _check(self):
        if self.source == "jsonl" and not self.path:
            raise ValueError("data.path: the jsonl source needs the path of your file")
        if self.min_terms > self.max_terms or self.min_digits > self.max_digits:
            raise ValueError("data.min_terms/min_digits: must not exceed max_terms/max_digits")
        return self
