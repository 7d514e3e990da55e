"""The ``decode`` section: how the decode loop samples when no vLLM engine does (SENT, the
evaluations and training's rollouts without vLLM), read by every stage that samples."""

from __future__ import annotations

from typing import ClassVar, Literal

from grpo.config.choices import Choice
from grpo.core.fields import Positive, Section


class DecodeConfig(Section):
    SECTION: ClassVar[str] = "decode"
    loop: Choice("decode.loop") = "auto"
    """``dynamic`` (finished rows leave the batch: least work, one host sync per token), ``static``
    (fixed shapes: a step that can be compiled) or ``auto``: static on CUDA, dynamic elsewhere
    (``grpo.rollout.sampling.plan_decode``)."""
    compile_step: Literal["auto", "on", "off"] = "auto"
    """Whether the static loop's step is compiled (``torch.compile``; on CUDA as a CUDA graph, mode
    ``reduce-overhead``), once per process and shape bucket. ``auto``: on CUDA when the stage
    decodes at least ``compile_min_tokens`` token steps (the compilation then pays for itself;
    docs/gpu-notes.md has the measurement); ``on`` also picks the static loop under ``loop: auto``."""
    compile_min_tokens: Positive = 1024
    """``compile_step: auto``'s threshold: the token steps a stage must decode for the compiled step."""
    check_every: Positive = 16
    """The static loop asks whether every row has ended every this many tokens (one host sync)."""
    length_bucket: Positive = 64
    """A compiled step's prompts are left-padded to a multiple of this many tokens (and a call's
    prompts to a power of two), so that calls of one bucket share one compilation."""
