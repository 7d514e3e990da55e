"""grpo.core.errors: one home for each error type (the loader, the stages and the command line catch the
same classes), and what a stage makes of each: one line on stderr and exit code 2, where any other
error keeps its traceback."""

from __future__ import annotations

import pytest

from grpo.config import reading as config
from grpo.config.params import params_from_dict
from grpo.config.sections.shared import OtherStagesTrainKeys
from grpo.core import errors
from grpo.core.errors import DeviceError, ModelConfigError, ParamsError, StageStop

from .conftest import REPO

KINDS = (ParamsError, ModelConfigError, DeviceError, StageStop)


def test_the_loader_raises_the_one_params_error_that_everyone_catches():
    """``grpo.config.reading`` re-exports the class, not a copy: ``except grpo.core.errors.ParamsError`` catches
    what loading raises; a params error is a ``ValueError``, a stage that cannot go on a ``RuntimeError``."""
    assert config.ParamsError is errors.ParamsError
    with pytest.raises(errors.ParamsError, match=r"^lora\.rank: must be > 0"):
        params_from_dict({"lora": {"rank": 0}})
    assert [k.__mro__[1] for k in KINDS] == [ValueError, ValueError, RuntimeError, RuntimeError]


@pytest.mark.parametrize("kind", KINDS, ids=lambda k: k.__name__)
def test_a_stage_says_each_in_one_line_and_exits_2(kind, capsys):
    from tasks._common import run_stage

    def body(params):
        raise kind("what is wrong and what to do")

    code = run_stage("train", body, (OtherStagesTrainKeys,), ["--params", str(REPO / "params.yaml")])
    assert (code, capsys.readouterr().err) == (2, "train: error: what is wrong and what to do\n")


def test_another_error_is_no_user_error_and_goes_on_with_its_traceback():
    from tasks._common import run_stage

    def body(params):
        raise KeyError("a bug")

    with pytest.raises(KeyError, match="a bug"):
        run_stage("train", body, (OtherStagesTrainKeys,), ["--params", str(REPO / "params.yaml")])
