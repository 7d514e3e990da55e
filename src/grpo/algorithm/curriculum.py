"""The curriculum: the order of the training rows and the rows of each step.

The SENT stage writes the training rows sorted easy -> hard. ``stages_for`` turns them into
stages of row indices by the order ``train.order`` names (``ORDERS``, one function each, of
signature ``(n_rows, num_stages, seed) -> list of stages``; ``num_stages`` is the order's option,
``train.order_options.<order>.num_stages``, 1 for an order without): ``curriculum`` cuts the file into ``num_stages`` contiguous, near-equal
slices, each shuffled by the seed; ``reversed`` is the same slices taken hard -> easy (the
anti-curriculum); ``shuffled`` is one seeded permutation of all rows (the comparison without a
curriculum); ``file`` is the file order. A run's steps are split evenly
over the stages (``stage_of_step``); within its stage a step takes the next ``k`` rows, wrapping
around (``batch_indices``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import ClassVar

from grpo.core.fields import Positive, Section
from grpo.core.registry import Registry

Order = Callable[[int, int, int], list[list[int]]]
ORDERS: Registry[Order] = Registry("train.order", "order")
"""Order name -> ``(n_rows, num_stages, seed) -> row indices per stage``."""


def curriculum_order(n_rows: int, num_stages: int, seed: int) -> list[list[int]]:
    """Row indices of each stage: ``num_stages`` contiguous, near-equal slices of ``range(n_rows)``
    (rows already sorted easy -> hard), each shuffled by ``seed``."""
    if not 1 <= num_stages <= n_rows:
        raise ValueError(f"num_stages must be in [1, {n_rows}], got {num_stages}")
    rng = random.Random(seed)
    bounds = [round(i * n_rows / num_stages) for i in range(num_stages + 1)]
    stages = []
    for lo, hi in zip(bounds[:-1], bounds[1:]):
        idx = list(range(lo, hi))
        rng.shuffle(idx)
        stages.append(idx)
    return stages


class CurriculumOptions(Section):
    """``train.order_options.curriculum``."""

    SECTION: ClassVar[str] = "train.order_options.curriculum"
    num_stages: Positive = 4
    """Slices of the sorted file; the run's steps are split evenly over them."""


class ReversedOptions(CurriculumOptions):
    """``train.order_options.reversed``."""

    SECTION: ClassVar[str] = "train.order_options.reversed"


def num_stages_of(cfg) -> int:
    """The stages the train section ``cfg``'s order cuts the rows into: its option
    (``train.order_options.<order>.num_stages``), 1 for an order without options."""
    options = cfg.order_options.get(cfg.order)
    return options.num_stages if options is not None else 1


def stages_for(order: str, n_rows: int, num_stages: int, seed: int) -> list[list[int]]:
    """Row indices per stage for ``train.order`` (an ``ORDERS`` name)."""
    return ORDERS[order](n_rows, num_stages, seed)


def _with_options(options: type[Section]):
    """Decorator: the order function declares ``options`` (``grpo.core.registry.Registry.options``)."""

    def attach(order: Order) -> Order:
        order.Options = options  # type: ignore[attr-defined]
        return order

    return attach


@ORDERS.register("curriculum")
@_with_options(CurriculumOptions)
def easy_to_hard(n_rows: int, num_stages: int, seed: int) -> list[list[int]]:
    """The curriculum; never more stages than rows."""
    return curriculum_order(n_rows, min(num_stages, n_rows), seed)


@ORDERS.register("reversed")
@_with_options(ReversedOptions)
def hard_to_easy(n_rows: int, num_stages: int, seed: int) -> list[list[int]]:
    """The curriculum's stages, rows within each shuffled alike, in the opposite order (hardest
    slice first)."""
    return easy_to_hard(n_rows, num_stages, seed)[::-1]


@ORDERS.register("shuffled")
def shuffled(n_rows: int, num_stages: int, seed: int) -> list[list[int]]:
    """One seeded permutation of all rows, one stage."""
    return curriculum_order(n_rows, 1, seed)


@ORDERS.register("file")
def file_order(n_rows: int, num_stages: int, seed: int) -> list[list[int]]:
    """The file's order, one stage."""
    return [list(range(n_rows))]


def stage_of_step(step: int, steps: int, num_stages: int) -> int:
    """0-based stage of 0-based ``step`` when ``steps`` are split evenly over ``num_stages``."""
    return min(step * num_stages // steps, num_stages - 1)


def batch_indices(stages: list[list[int]], step: int, steps: int, k: int) -> list[int]:
    """Row indices of 0-based ``step``: its stage's next ``k`` rows, wrapping around within the stage."""
    s = stage_of_step(step, steps, len(stages))
    first = -(-s * steps // len(stages))  # first step of stage s: ceil(s * steps / num_stages)
    idx = stages[s]
    return [idx[((step - first) * k + i) % len(idx)] for i in range(k)]
