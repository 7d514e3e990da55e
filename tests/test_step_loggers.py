"""``grpo.training.step_loggers``: dvclive's step files from the trainer's rows (a None value left out at
its step), dvclive optional (not importable: one warning, the other loggers still log), wandb off
when disabled (``WANDB_MODE`` over ``train.wandb.mode``). wandb's offline run through the stage:
tests/test_stage_train.py."""

from __future__ import annotations

import json
import logging
import sys

from grpo.config.params import AllParams
from grpo.training.step_loggers import dvclive_logger, step_loggers, wandb_logger


def _params(tmp_path, **train) -> AllParams:
    return AllParams.model_validate({"train": {"metrics_dir": str(tmp_path / "metrics"),
                                            "output_dir": str(tmp_path / "out"), **train}})


def test_dvclive_writes_each_statistic_per_step_and_skips_none(tmp_path):
    log, close = dvclive_logger(tmp_path)
    log({"step": 1, "loss": 0.5, "kl": None})
    log({"step": 2, "loss": 0.25, "kl": 0.1})
    close()
    plots = tmp_path / "train" / "plots" / "metrics"
    assert (plots / "loss.tsv").read_text().splitlines()[1:] == ["1\t0.5", "2\t0.25"]
    assert (plots / "kl.tsv").read_text().splitlines()[1:] == ["2\t0.1"]
    assert json.loads((tmp_path / "train" / "metrics.json").read_text())["loss"] == 0.25


def test_wandb_disabled_by_the_param_or_the_environment_logs_nothing(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_MODE", raising=False)
    assert wandb_logger(_params(tmp_path, wandb={"mode": "disabled"})) == (None, None)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_logger(_params(tmp_path, wandb={"mode": "offline"})) == (None, None)
    loggers, closers = step_loggers(_params(tmp_path, wandb={"mode": "offline"}))
    assert len(loggers) == len(closers) == 1  # dvclive alone
    assert not (tmp_path / "out").exists()  # no wandb run id kept


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "grpo.training.step_loggers" and r.levelno == logging.WARNING]


def test_without_dvclive_one_warning_line_and_no_logger(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "dvclive", None)  # `import dvclive` raises ImportError, as when absent
    with caplog.at_level(logging.WARNING, logger="grpo.training.step_loggers"):
        assert dvclive_logger(tmp_path) == (None, None)
    [line] = _warnings(caplog)
    assert "dvclive" in line and "dvc plots" in line and str(tmp_path / "train.json") in line
    assert "\n" not in line and not (tmp_path / "train").exists()


def test_without_dvclive_the_other_loggers_still_log(tmp_path, monkeypatch, caplog):
    monkeypatch.setitem(sys.modules, "dvclive", None)
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    with caplog.at_level(logging.WARNING, logger="grpo.training.step_loggers"):
        loggers, closers = step_loggers(_params(tmp_path, wandb={"mode": "offline"}))
    assert len(loggers) == len(closers) == 1 and len(_warnings(caplog)) == 1  # wandb alone
    loggers[0]({"step": 1, "loss": 0.5})
    closers[0]()
    runs = list((tmp_path / "out" / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and any(runs[0].glob("*.wandb"))
