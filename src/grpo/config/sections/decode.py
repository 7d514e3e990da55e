"""The ``decode`` section: how the decode loop samples when no vLLM engine does (SENT, the
evaluations and training's rollouts without vLLM), read by every stage that samples. A loop's own
options sit under its name (``decode.loop_options.static.check_every``: ``grpo.rollout.sampling``,
each loop's ``Options``)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from grpo.config.choices import Choice, EntryOptions, entry_defaults
from grpo.core.fields import Positive, Section

MOVED: dict[str, str] = {
    "check_every": "decode.loop_options.static.check_every",
    "length_bucket": "decode.loop_options.static.length_bucket",
}
"""Every key the decode section had once -> where it lives now (one line each)."""


class DecodeConfig(Section):
    SECTION: ClassVar[str] = "decode"
    MOVED: ClassVar[dict[str, str]] = MOVED
    loop: Choice("decode.loop") = "auto"
    """``dynamic`` (finished rows leave the batch: least work, one host sync per token), ``static``
    (fixed shapes: a step that can be compiled) or ``auto``: static on CUDA, dynamic elsewhere
    (``grpo.rollout.sampling.plan_decode``)."""
    loop_options: EntryOptions("decode.loop") = Field(default_factory=entry_defaults("decode.loop"))
    """Each loop's own options under its name (``grpo.rollout.sampling.DECODE_LOOPS``: ``static``'s
    ``check_every`` and ``length_bucket``; the dynamic loop has none); the chosen loop's apply."""
    compile_step: Literal["auto", "on", "off"] = "auto"
    """Whether the static loop's step is compiled (``torch.compile``; on CUDA as a CUDA graph, mode
    ``reduce-overhead``), once per process and shape bucket. ``auto``: on CUDA when the stage
    decodes at least ``compile_min_tokens`` token steps (the compilation then pays for itself;
    docs/gpu-notes.md has the measurement); ``on`` also picks the static loop under ``loop: auto``."""
    compile_min_tokens: Positive = 1024
    """``compile_step: auto``'s threshold: the token steps a stage must decode for the compiled step."""
