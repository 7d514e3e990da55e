"""The ``train`` keys that stages other than train read (the system prompt of every prompt, the
metrics folder, the trained adapter's folder).

``TrainConfig`` inherits them, so their defaults have this one home; a stage that reads only these
loads the ``train`` section as ``OtherStagesTrainKeys`` (the section's other keys are left to the train
stage to validate), so it does not depend on ``grpo/config/sections/train.py`` and an edit of the train
schema re-runs only the stages that train.
"""

from __future__ import annotations

from typing import ClassVar

from pydantic import ConfigDict

from grpo.core.fields import Section

DEFAULT_SYSTEM_PROMPT = (
    "Solve the math problem. Think briefly, then give the final answer on its own line as '#### <number>'."
)


class SharedTrainKeys(Section):
    SECTION: ClassVar[str] = "train"
    metrics_dir: str = "metrics"
    """``train.json`` (summary) and ``train/`` (per-step plots data) go here; the other stages
    write their metrics here too."""
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    """System message (chat template) or preamble (plain template) of every prompt."""
    adapter_dir: str = "models/adapter"
    """The trained adapter, PEFT format (the train stage writes it, final_eval reads it)."""


class OtherStagesTrainKeys(SharedTrainKeys):
    """The ``train`` section as a stage other than train reads it: these keys validated, the rest
    ignored."""

    model_config = ConfigDict(extra="ignore", strict=True)
