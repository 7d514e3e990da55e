"""``grpo.step_loggers``: dvclive's step files from the trainer's rows (a None value left out at
its step), wandb off when disabled (``WANDB_MODE`` over ``train.wandb_mode``). wandb's offline run
through the stage: tests/test_stage_train.py."""

from __future__ import annotations

import json

from grpo.params import AllParams
from grpo.step_loggers import dvclive_logger, step_loggers, wandb_logger


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
    assert wandb_logger(_params(tmp_path, wandb_mode="disabled")) == (None, None)
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_logger(_params(tmp_path, wandb_mode="offline")) == (None, None)
    loggers, closers = step_loggers(_params(tmp_path, wandb_mode="offline"))
    assert len(loggers) == len(closers) == 1  # dvclive alone
    assert not (tmp_path / "out").exists()  # no wandb run id kept
