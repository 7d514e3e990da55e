"""The evaluation stages (``python -m tasks.baseline_eval``) on bad input: one line, exit 2, and no
work folder left behind."""

import subprocess
import sys

import pytest
import yaml

from grpo.core.jsonio import write_jsonl
from tests.conftest import REPO


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
@pytest.mark.parametrize("files", [[], ["config.json"]], ids=["empty", "no-weights"])
def test_baseline_eval_names_an_empty_model_folder_and_leaves_nothing(tmp_path, tiny_problems, files):
    """In a workspace whose model folder is empty, or has a config but no weights: exit 2, one line
    naming the folder and what it lacks; no outputs/eval (work folder or results) and no metrics."""
    model = tmp_path / "models" / "base"
    model.mkdir(parents=True)
    for name in files:
        (model / name).write_text("{}")
    write_jsonl(tmp_path / "data" / "raw" / "test.jsonl", tiny_problems)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump({"model": {"path": "models/base"}}))
    proc = subprocess.run([sys.executable, "-m", "tasks.baseline_eval"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**__import__("os").environ, "PYTHONPATH": str(REPO)})
    lacks = "no weights: no *.safetensors or pytorch_model*.bin" if files else "no config.json"
    assert (proc.returncode, proc.stdout) == (2, "")
    assert proc.stderr.splitlines() == [f"baseline_eval: error: model.path: models/base: no model there ({lacks}); "
                                        "run `dvc repro prepare_model` first"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.name != "outputs") == ["data", "models", "params.yaml"]
    outputs = tmp_path / "outputs"  # at most the stage's log of other libraries' lines (grpo.core.console), never a result
    assert not outputs.exists() or [p.name for p in outputs.iterdir()] == ["logs"]


def test_an_evaluation_that_fails_midway_removes_its_work_folder(tmp_path, monkeypatch):
    """The exported weights' folder is removed when the evaluation raises after writing it."""
    from grpo.config.params import AllParams
    from tasks import _eval_stage

    def failing(params, adapter_dir, work):
        (work / "weights").mkdir(parents=True)
        raise RuntimeError("engine died")

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(_eval_stage, "evaluate", failing)
    with pytest.raises(RuntimeError, match="engine died"):
        _eval_stage.run_eval(AllParams(), "baseline", None)
    assert list((tmp_path / "outputs" / "eval").iterdir()) == []
