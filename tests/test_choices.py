"""grpo.config.choices: every choice param validates against its registry, and only against it."""

from __future__ import annotations

import pytest

from grpo.config.choices import REGISTRIES, registry
from grpo.config.params import params_from_dict
from grpo.config.reading import ParamsError


def _params_with(param: str, name: str):
    *path, key = param.split(".")  # train.loss.entropy_rule: a key in a part of a section
    tree = {key: {name: 1.0} if param == "train.rewards" else name}
    for part in reversed(path):
        tree = {part: tree}
    return params_from_dict(tree)


@pytest.mark.parametrize("param", sorted(REGISTRIES))
def test_every_registered_name_validates_and_every_valid_name_resolves(param):
    reg = registry(param)
    assert reg.names(), f"{param}: an empty registry"
    for name in reg.accepted():
        _params_with(param, name)  # validates
        if name not in reg.also:
            assert reg[name] is not None  # resolves


@pytest.mark.parametrize("param", sorted(REGISTRIES))
def test_an_unknown_name_is_one_line_naming_the_param(param):
    with pytest.raises(ParamsError) as err:
        _params_with(param, "no_such_entry")
    assert str(err.value).startswith(f"{param}: must be one of ") and "\n" not in str(err.value)


def test_an_entry_registered_elsewhere_is_valid_at_once():
    """The allowed values are the registry's: an entry registered from outside the project (here,
    this test) validates without an edit of grpo.config.reading."""
    reg = registry("train.order")
    with pytest.raises(ParamsError):
        _params_with("train.order", "toy_order")
    with reg.registered("toy_order", lambda n_rows, num_stages, seed: [list(range(n_rows))]):
        assert _params_with("train.order", "toy_order").train.order == "toy_order"
