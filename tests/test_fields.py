"""grpo.core.fields: a section built on it fails in one line naming the field, records the keys read,
and the module reaches neither a registry nor the params' reading."""

from __future__ import annotations

from typing import ClassVar

import pytest

from grpo.core.errors import ParamsError
from grpo.core.fields import Fraction, Positive, Section, reading_params
from grpo.tools.code_deps import Project

from .conftest import REPO


class Toy(Section):
    SECTION: ClassVar[str] = "toy"
    steps: Positive = 3
    share: Fraction = 0.5


@pytest.mark.parametrize(("values", "message"), [
    ({"steps": 0}, "toy.steps: must be > 0, got 0"),
    ({"share": 1.5}, "toy.share: must be <= 1, got 1.5"),
    ({"steps": "ten"}, "toy.steps: must be an integer, got 'ten'"),
])
def test_a_bad_value_is_one_line_naming_the_field(values, message):
    with pytest.raises(ParamsError) as err:
        Toy(**values)
    assert str(err.value).startswith(message)


def test_reading_params_records_the_keys_read():
    toy = Toy()
    with reading_params() as reads:
        assert toy.steps == 3
    assert reads == {"toy.steps"}


def test_fields_reach_no_registry_and_no_params_reading():
    deps = Project(REPO).code_deps(REPO / "src/grpo/core/fields.py")
    assert deps == {"src/grpo/core/__init__.py", "src/grpo/core/fields.py", "src/grpo/core/errors.py"}
