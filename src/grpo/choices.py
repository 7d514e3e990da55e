"""Every registry of the params, by the param it serves: the one list ``grpo.config`` validates
against and the how-tos point to.

A choice param's allowed values are its registry's names (``grpo.registry``); the entries are
registered where they are implemented, so importing this module imports those modules. Params
validation imports it lazily (``grpo.config.Choice``): a registered name decides whether params
are valid, not what a stage writes, so a stage's code dependencies are the modules it runs
(tests/test_dvc_graph.py leaves this module's imports out of them).
"""

from __future__ import annotations

import importlib

from grpo.registry import Registry

REGISTRIES: dict[str, tuple[str, str]] = {
    "train.order": ("grpo.curriculum", "ORDERS"),
    "train.rewards": ("grpo.rewards", "REWARDS"),
    "sent.backend": ("grpo.rollout_backends", "ROLLOUT_BACKENDS"),
    "evaluate.backend": ("grpo.rollout_backends", "ROLLOUT_BACKENDS"),
    "train.rollouts.backend": ("grpo.rollout_backends", "ROLLOUT_BACKENDS"),
    "train.loss.loss_type": ("grpo.loss", "AGGREGATIONS"),
    "train.loss.policy_loss": ("grpo.loss", "POLICY_LOSSES"),
    "train.loss.entropy_rule": ("grpo.entropy", "TOKEN_RULES"),
    "train.rollouts.engine_weights": ("grpo.engine.forms_catalogue", "WEIGHTS_FORMS"),
    "decode.loop": ("grpo.sampling", "DECODE_LOOPS"),
}
"""``section.key`` -> (module, attribute) of the registry whose names the param takes."""


def registry(param: str) -> Registry:
    """The registry serving ``param`` (``KeyError`` for a param that is not a registered choice)."""
    module, attribute = REGISTRIES[param]
    return getattr(importlib.import_module(module), attribute)
