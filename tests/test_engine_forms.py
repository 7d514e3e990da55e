"""grpo.rollout.engine.forms: the ``auto`` weights form decided once from the usable forms' needs, and the
one line of what each training process runs."""

from __future__ import annotations

import pytest

from grpo.rollout.engine.forms import choose_form, rollouts_per_process

GIB = 2**30
NF4_NEEDS = 1 * GIB
"""The nf4 engine's needs in these cases: below the dense one's, as its weights are the norms alone."""


def both(dense_need: int | None) -> list[tuple[str, int | None]]:
    """The two registered forms, usable (a 4-bit base), with their needs (None: not computed)."""
    return [("dense", dense_need), ("nf4", None if dense_need is None else NF4_NEEDS)]


def test_auto_is_dense_where_it_fits_else_nf4_and_dense_on_a_cpu():
    assert choose_form("auto", "cuda", both(3 * GIB), 4 * GIB, 0.5) == ("dense", "auto: dense needs 3.00 GiB <= the budget 4.00 GiB")
    assert choose_form("auto", "cuda", both(5 * GIB), 4 * GIB, 0.5) == ("nf4", "auto: dense needs 5.00 GiB > the budget 4.00 GiB")
    assert choose_form("auto", "cuda:1", both(5 * GIB), 4 * GIB, 0.5)[0] == "nf4"
    # neither fits: the leanest, the message the same
    assert choose_form("auto", "cuda", both(5 * GIB), GIB // 2, 0.5) == ("nf4", "auto: dense needs 5.00 GiB > the budget 0.50 GiB")
    form, why = choose_form("auto", "cuda", both(3 * GIB), None, 0.5)
    assert form == "dense" and "cards from 6.00 GiB" in why
    assert choose_form("auto", "cpu", both(None), None, 0.5) == ("dense", "auto: dense on a CPU")
    assert choose_form("nf4", "cpu", both(None), None, 0.5) == ("nf4", "train.rollouts.engine_weights")


def test_auto_never_picks_nf4_without_a_4bit_base():
    form, why = choose_form("auto", "cuda", [("dense", None)], 4 * GIB, 0.5,
                            left_out=["model.quantization none: no 4-bit base to share"])
    assert (form, why) == ("dense", "auto: dense (model.quantization none: no 4-bit base to share)")


def test_auto_over_three_forms_takes_the_first_that_fits_naming_those_before_it():
    forms = [("dense", 5 * GIB), ("nf4", 3 * GIB), ("lean", 2 * GIB)]
    assert choose_form("auto", "cuda", forms, 4 * GIB, 0.5) == ("nf4", "auto: dense needs 5.00 GiB > the budget 4.00 GiB")
    assert choose_form("auto", "cuda", forms, GIB, 0.5) == (
        "lean", "auto: dense needs 5.00 GiB, nf4 needs 3.00 GiB > the budget 1.00 GiB")


def test_what_each_process_runs():
    assert rollouts_per_process(True, 2, "dense") == "each of 2 processes: a vLLM engine of its own holding the policy (dense weights)"
    assert rollouts_per_process(False, 1, None) == "the process: the decode loop on the policy (transformers)"


def test_each_form_is_named_by_its_registration_and_nf4_needs_the_4bit_base():
    from grpo.config.params import params_from_dict
    from grpo.config.reading import ParamsError
    from grpo.rollout.engine.forms import form_name
    from grpo.rollout.engine.forms_catalogue import WEIGHTS_FORMS

    dense, nf4 = WEIGHTS_FORMS["dense"], WEIGHTS_FORMS["nf4"]
    assert object.__new__(nf4).name == "nf4" and object.__new__(dense).name == "dense"
    with pytest.raises(KeyError, match="not registered"):
        form_name(type("Unregistered", (dense,), {}))
    assert (nf4.forces_eager, nf4.engine_lora(16), dense.forces_eager, dense.engine_lora(16)) == (True, 16, False, None)
    plain = params_from_dict({"model": {"quantization": "none"}})
    with pytest.raises(ParamsError, match=r"^train.rollouts.engine_weights: nf4 shares the trainer's 4-bit base"):
        nf4.check_params(plain)
    with pytest.raises(ParamsError, match=r"^train.rollouts.engine_weights: nf4 shares"):  # params validation asks the form
        params_from_dict({"model": {"quantization": "none"}, "train": {"rollouts": {"engine_weights": "nf4"}}})
