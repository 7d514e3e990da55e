"""The building blocks of every params schema: the field types and ``Section``, the base of a section.

A section (``grpo.config.sections``) and a registered entry's ``Options`` model (``grpo.algorithm.entropy``,
``grpo.algorithm.loss``, ``grpo.algorithm.curriculum``) are built on this module alone: it imports no registry and no
loader, so an entry that ``grpo.config.choices`` looks up by name never imports the params' reading
(``grpo.config.reading``) or the registries back. The fields that take a registry's names (``Choice``,
``EntryOptions``) live with the registries, in ``grpo.config.choices``.

Contract:

* ``Section`` forbids unknown keys and loose types (``"ten"`` is not an integer, ``true`` is not a
  number). Building one with a bad value raises ``ParamsError`` (``grpo.core.errors``) of one line
  naming the field (``train.optimizer.lr: must be > 0, got -1.0``; the wording is
  ``grpo.core.messages``', imported only on that failure's way); ``MOVED`` names the new place of a key
  that moved.
* ``reading_params()`` records which ``section.key`` fields of any ``Section`` are read while it
  is active (the stages run under it when asked, so a test can check each stage's ``params:`` in
  ``dvc.yaml``).
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from grpo.core.errors import ParamsError

Positive = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegative = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]
Dtype = Literal["auto", "bfloat16", "float16", "float32"]

_READS: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("grpo_param_reads", default=None)


@contextlib.contextmanager
def reading_params():
    """Collect the ``section.key`` names of every params field read inside the block."""
    reads: set[str] = set()
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)


class Section(BaseModel):
    """Base of the params sections: unknown keys and loose types are errors; reads are recordable."""

    model_config = ConfigDict(extra="forbid", strict=True)
    SECTION: ClassVar[str] = ""
    MOVED: ClassVar[dict[str, str]] = {}
    """Keys this section had once -> where they live now (the message for an old params file)."""

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as err:
            # lazy: a failure path's wording; grpo.core.messages stays out of every stage's deps
            from grpo.core.messages import one_line

            raise ParamsError(one_line(err, type(self))) from None

    def __getattribute__(self, name: str):
        reads = _READS.get()
        if reads is not None and not name.startswith("_") and name in type(self).model_fields:
            value = super().__getattribute__(name)
            if not isinstance(value, Section):  # a part (``train.loss``) records the keys read in it
                reads.add(f"{type(self).SECTION}.{name}")
            return value
        return super().__getattribute__(name)
