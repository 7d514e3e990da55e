"""grpo.engine.forms: the ``auto`` weights form decided once from the dense engine's needs, and the
one line of what each training process runs."""

from __future__ import annotations

from grpo.engine.forms import choose_form, rollouts_per_process

GIB = 2**30


def test_auto_is_dense_where_it_fits_else_nf4_and_dense_on_a_cpu():
    assert choose_form("auto", "cuda", 3 * GIB, 4 * GIB, 0.5) == ("dense", "auto: dense needs 3.00 GiB <= the budget 4.00 GiB")
    assert choose_form("auto", "cuda", 5 * GIB, 4 * GIB, 0.5)[0] == "nf4"
    assert choose_form("auto", "cuda:1", 5 * GIB, 4 * GIB, 0.5)[0] == "nf4"
    form, why = choose_form("auto", "cuda", 3 * GIB, None, 0.5)
    assert form == "dense" and "cards from 6.00 GiB" in why
    assert choose_form("auto", "cpu", None, None, 0.5)[0] == "dense"
    assert choose_form("nf4", "cpu", None, None, 0.5) == ("nf4", "train.engine_weights")


def test_auto_never_picks_nf4_without_a_4bit_base():
    form, why = choose_form("auto", "cuda", 5 * GIB, 4 * GIB, 0.5, nf4_base=False)
    assert form == "dense" and "model.quantization none" in why


def test_what_each_process_runs():
    assert rollouts_per_process(True, 2, "dense") == "each of 2 processes: a vLLM engine of its own holding the policy (dense weights)"
    assert rollouts_per_process(False, 1, None) == "the process: the decode loop on the policy (transformers)"


def test_a_form_outside_the_list_fails_naming_the_param():
    import pytest

    from grpo.engine.forms import check_form

    assert check_form("nf4") == "nf4"
    with pytest.raises(ValueError, match=r"engine_weights: must be one of dense, nf4 .*got 'auto'"):
        check_form("auto")
