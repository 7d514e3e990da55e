"""The weights forms' catalogue (``grpo.rollout.engine.forms_catalogue``): importing it registers every form;
a name looks up its class, or fails naming the param; which forms can serve the params."""

from __future__ import annotations

import pytest

from grpo.config.params import params_from_dict
from grpo.rollout.engine.forms_catalogue import WEIGHTS_FORMS, usable_forms, weights_form


def test_the_catalogue_registers_every_form_in_its_order():
    from grpo.config.choices import registry
    from grpo.rollout.engine.dense_form import DenseForm
    from grpo.rollout.engine.nf4_form import NF4Form

    assert registry("train.rollouts.engine_weights") is WEIGHTS_FORMS  # the param's registry
    assert dict(WEIGHTS_FORMS) == {"dense": DenseForm, "nf4": NF4Form}
    assert WEIGHTS_FORMS.accepted() == ("auto", "dense", "nf4")


def _register_in(order: list[str], entries: dict) -> None:
    for name in list(WEIGHTS_FORMS):
        del WEIGHTS_FORMS[name]
    for name in order:
        WEIGHTS_FORMS[name] = entries[name]


def test_auto_tries_the_forms_by_their_priority_whatever_the_import_order():
    """``auto``'s order is each form's ``auto_priority``: a form registered last with a priority
    between dense's and nf4's comes second, and reversing the registration order changes nothing."""
    from grpo.rollout.engine.forms import WeightsForm
    from grpo.rollout.engine.forms_catalogue import auto_order

    class Middle(WeightsForm):
        auto_priority = (WEIGHTS_FORMS["dense"].auto_priority + WEIGHTS_FORMS["nf4"].auto_priority) // 2

    original = dict(WEIGHTS_FORMS)
    entries = {**original, "middle": Middle}
    try:
        _register_in([*original, "middle"], entries)
        assert auto_order() == ["dense", "middle", "nf4"]
        assert usable_forms(params_from_dict({}))[0] == ["dense", "middle", "nf4"]
        _register_in(["middle", *reversed(original)], entries)
        assert list(WEIGHTS_FORMS) == ["middle", "nf4", "dense"] and auto_order() == ["dense", "middle", "nf4"]
    finally:
        _register_in(list(original), original)


def test_a_name_outside_the_registry_fails_naming_the_param():
    assert weights_form("nf4") is WEIGHTS_FORMS["nf4"]
    with pytest.raises(ValueError, match=r"^engine_weights: must be one of dense, nf4 \(the caller resolves auto\); got 'auto'$"):
        weights_form("auto")


def test_the_usable_forms_and_why_the_others_are_not():
    assert usable_forms(params_from_dict({})) == (["dense", "nf4"], [])
    assert usable_forms(params_from_dict({"model": {"quantization": "none"}})) == (
        ["dense"], ["model.quantization none: no 4-bit base to share"])
