"""The weights forms' catalogue (``grpo.engine.forms_catalogue``): importing it registers every form;
a name looks up its class, or fails naming the param; which forms can serve the params."""

from __future__ import annotations

import pytest

from grpo.config import params_from_dict
from grpo.engine.forms_catalogue import WEIGHTS_FORMS, usable_forms, weights_form


def test_the_catalogue_registers_every_form_in_its_order():
    from grpo.choices import registry
    from grpo.engine.dense_form import DenseForm
    from grpo.engine.nf4_form import NF4Form

    assert registry("train.engine_weights") is WEIGHTS_FORMS  # the param's registry
    assert dict(WEIGHTS_FORMS) == {"dense": DenseForm, "nf4": NF4Form}  # registration order: auto's preference
    assert WEIGHTS_FORMS.accepted() == ("auto", "dense", "nf4")


def test_a_name_outside_the_registry_fails_naming_the_param():
    assert weights_form("nf4") is WEIGHTS_FORMS["nf4"]
    with pytest.raises(ValueError, match=r"^engine_weights: must be one of dense, nf4 \(the caller resolves auto\); got 'auto'$"):
        weights_form("auto")


def test_the_usable_forms_and_why_the_others_are_not():
    assert usable_forms(params_from_dict({})) == (["dense", "nf4"], [])
    assert usable_forms(params_from_dict({"model": {"quantization": "none"}})) == (
        ["dense"], ["model.quantization none: no 4-bit base to share"])
