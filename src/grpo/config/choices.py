"""Every registry of the params, by the param it serves, and the field types that take their names:
the one list the sections validate against and the how-tos point to.

A choice param's allowed values are its registry's names (``grpo.core.registry``); the entries are
registered where they are implemented, and ``registry(param)`` imports the one module serving
``param`` by name (``importlib``) when a value is checked. An entry's options are built on
``grpo.core.fields`` alone, so no module this one looks up imports the params' reading (``grpo.config.reading``).
A section with a choice imports this module, and one module looked up here imports such a section
(``grpo.rollout.rollout_backends``, the decode section): that loop closes only when a value is checked,
after both are loaded (``python -m grpo.tools.code_deps graph`` lists it). A registered name decides whether params are valid,
not what a stage writes, so a stage's code dependencies are the modules it runs (``grpo.tools.code_deps``
leaves the modules named in ``REGISTRIES`` out of them).
"""

from __future__ import annotations

import importlib
from typing import Annotated, Any

from pydantic import AfterValidator

from grpo.core.registry import Registry

REGISTRIES: dict[str, tuple[str, str]] = {
    "train.order": ("grpo.algorithm.curriculum", "ORDERS"),
    "train.rewards": ("grpo.algorithm.rewards", "REWARDS"),
    "sent.backend": ("grpo.rollout.rollout_backends", "ROLLOUT_BACKENDS"),
    "evaluate.backend": ("grpo.rollout.rollout_backends", "ROLLOUT_BACKENDS"),
    "train.rollouts.backend": ("grpo.rollout.rollout_backends", "ROLLOUT_BACKENDS"),
    "train.loss.loss_type": ("grpo.algorithm.loss", "AGGREGATIONS"),
    "train.loss.policy_loss": ("grpo.algorithm.loss", "POLICY_LOSSES"),
    "train.loss.entropy_rule": ("grpo.algorithm.entropy", "TOKEN_RULES"),
    "train.rollouts.engine_weights": ("grpo.rollout.engine.forms_catalogue", "WEIGHTS_FORMS"),
    "decode.loop": ("grpo.rollout.sampling", "DECODE_LOOPS"),
}
"""``section.key`` -> (module, attribute) of the registry whose names the param takes."""


def registry(param: str) -> Registry:
    """The registry serving ``param`` (``KeyError`` for a param that is not a registered choice)."""
    module, attribute = REGISTRIES[param]
    return getattr(importlib.import_module(module), attribute)


def Choice(param: str):  # noqa: N802 (a type)
    """A text field whose values are the names of the registry serving ``param`` (``registry``):
    the allowed values have that one home, and an entry registered anywhere is a valid value.
    Checked when the section is built; an unknown name is one line naming ``param`` and the names
    it takes."""

    def check(value: str) -> str:
        return registry(param).check(value, param)

    return Annotated[str, AfterValidator(check)]


def EntryOptions(param: str):  # noqa: N802 (a type)
    """A mapping of entry name -> that entry's options, for the entries of the registry serving
    ``param`` that declare an ``Options`` model (``grpo.core.registry.Registry.options``); each value is
    validated by its entry's model, and an entry left out takes its model's defaults, so the
    defaults have one home, the entry. A name without options is one line naming the names that
    have them."""

    def check(value: dict) -> dict:
        reg, key = registry(param), f"{param}_options"
        out = {}
        for name, values in value.items():
            model = reg.options(name)
            if model is None:
                raise ValueError(f"{key}.{name}: no {reg.what} of that name has options; those that do: "
                                 f"{', '.join(reg.with_options())}")
            if not isinstance(values, (dict, model)):
                raise ValueError(f"{key}.{name}: must be a mapping, got {values!r}")
            out[name] = values if isinstance(values, model) else model(**values)
        return {**entry_defaults(param)(), **out}  # the entries left out at their defaults, in registration order

    return Annotated[dict[str, Any], AfterValidator(check)]


def entry_defaults(param: str):
    """The default of an ``EntryOptions(param)`` field: each entry's options at their defaults."""

    def make() -> dict:
        reg = registry(param)
        return {name: reg.options(name)() for name in reg.with_options()}

    return make
