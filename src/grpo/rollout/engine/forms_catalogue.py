"""Every weights form of the train engine, registered: importing this module imports each form's
module, which registers its class in ``grpo.rollout.engine.forms.WEIGHTS_FORMS``.

The registry's home for everyone who looks a form up by name (``grpo.config.choices`` for
``train.rollouts.engine_weights``, ``grpo.rollout.engine.policy_engine``, ``grpo.rollout.engine.needs``): with it the
entries are there. A module of its own because ``grpo.rollout.engine.forms`` (the base class and the
registry) is imported by the form modules and so cannot import them back (an import cycle), and
because a stage's code dependencies follow imports (tests/test_dvc_graph.py): the forms are named
here, statically, one line each. A new form adds its line; the order of the imports decides
nothing (``auto`` goes by each form's ``auto_priority``).
"""

from __future__ import annotations

from grpo.rollout.engine import dense_form, nf4_form  # noqa: F401 (each registers its form)
from grpo.rollout.engine.forms import WEIGHTS_FORMS, WeightsForm


def weights_form(name: str) -> type[WeightsForm]:
    """The class of the form ``name``; ``ValueError`` naming the param for any other name (``auto``
    is resolved by ``grpo.rollout.engine.forms.choose_form`` before an engine is built)."""
    if name not in WEIGHTS_FORMS:
        raise ValueError(f"engine_weights: must be one of {', '.join(WEIGHTS_FORMS)} (the caller resolves auto); "
                         f"got {name!r}")
    return WEIGHTS_FORMS[name]


def auto_order() -> list[str]:
    """The registered forms in the order ``auto`` tries them: by each form's ``auto_priority``,
    then by name."""
    return sorted(WEIGHTS_FORMS, key=lambda name: (WEIGHTS_FORMS[name].auto_priority, name))


def usable_forms(params) -> tuple[list[str], list[str]]:
    """``(usable, left_out)``: the names of the forms that can serve ``params``, in ``auto``'s order
    (``auto_order``), and why each other cannot (its ``unusable``)."""
    usable, left_out = [], []
    for name in auto_order():
        form = WEIGHTS_FORMS[name]
        why = form.unusable(params)
        if why is None:
            usable.append(name)
        else:
            left_out.append(why)
    return usable, left_out
