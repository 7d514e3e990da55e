"""``flows.overrides``: the flow's ``--set`` values read as YAML, and the check of params.yaml with them
put over it, in memory: one line naming the key, the file untouched. The command line's refusal before
Prefect is imported: tests/test_flow_pipeline.py."""

from __future__ import annotations

import shutil

import pytest
import yaml

from flows.overrides import check_params, check_run_params, override_values
from grpo.core.errors import ParamsError

from .conftest import REPO


def test_values_are_read_as_yaml():
    assert override_values({"train.optimizer.lr": "5e-4", "train.steps": "40", "model.name": "x", "a": "[1, 2]",
                            "b": 3}) == {"train.optimizer.lr": 5e-4, "train.steps": 40, "model.name": "x", "a": [1, 2],
                                         "b": 3}


def test_the_params_with_the_overrides_are_checked_without_writing(tmp_path):
    params = tmp_path / "params.yaml"
    params.write_text((REPO / "params.yaml").read_text())
    check_params(params, {"train.seed": "3", "train.optimizer.lr": "1e-3"})  # valid: no error
    check_params(params)
    for overrides, line in (({"train.steps": "forty"}, "train.steps: must be an integer, got 'forty'"),
                            ({"train.nonexistent": "1"}, "train.nonexistent: unknown key")):
        with pytest.raises(ParamsError) as err:
            check_params(params, overrides)
        assert str(err.value).startswith(f"overrides {', '.join(overrides)} over {params}: {line}")
        assert "\n" not in str(err.value)
    params.write_text(params.read_text().replace("\n  rank: ", "\n  rank: 0 #", 1))
    with pytest.raises(ParamsError, match=f"^{params}: lora.rank: "):
        check_params(params)
    assert "rank: 0 #" in params.read_text()
    check_params(tmp_path / "none.yaml")  # a workspace without params: nothing to check
    with pytest.raises(ParamsError, match="none.yaml: params file not found"):
        check_params(tmp_path / "none.yaml", {"train.seed": "1"})


def test_a_workspace_is_checked_when_its_dvc_yaml_has_the_guard_or_the_run_sets_params(tmp_path):
    (tmp_path / "params.yaml").write_text("unused: 1\n")  # not this project's params
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"one": {"cmd": "true"}}}))
    check_run_params(tmp_path)  # another project's stages: theirs to check
    with pytest.raises(ParamsError, match="overrides train.seed over .*: unused: unknown params section"):
        check_run_params(tmp_path, {"train.seed": "1"})
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")  # this project's, check_params first
    with pytest.raises(ParamsError, match=r"params.yaml: unused: unknown params section"):
        check_run_params(tmp_path)
