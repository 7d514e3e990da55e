"""The per-step loggers of training: dvclive (``<train.metrics_dir>/train/``, for ``dvc plots``;
optional: without it one warning and no step files) and wandb (unless disabled). Each is a callback
the trainer calls with every step's row, and a function that closes it once the run has shipped."""

from __future__ import annotations

import logging
import os
import uuid
from collections.abc import Callable
from pathlib import Path

from grpo.config.reading import Params

Logger = Callable[[dict], None]
log = logging.getLogger(__name__)


def dvclive_logger(metrics_dir: Path) -> tuple[Logger | None, Callable[[], None] | None]:
    """dvclive's step files and summary under ``metrics_dir / "train"`` (``dvcyaml=None``: it leaves
    ``dvc.yaml`` alone); a statistic that is None in a row is not logged at that step. Where dvclive
    (or a module it imports) cannot be imported, as on a GPU machine without DVC: one WARNING line
    naming the missing module and what is lost, and ``(None, None)``; training goes on without it."""
    try:
        from dvclive import Live
    except ImportError as exc:
        log.warning("dvclive is not importable (%s): no per-step metrics under %s for `dvc plots`; "
                    "training goes on and still writes %s", exc, metrics_dir / "train", metrics_dir / "train.json")
        return None, None

    live = Live(dir=str(metrics_dir / "train"), dvcyaml=None, save_dvc_exp=False, report=None)

    def cb(row: dict) -> None:
        live.step = row["step"]
        for key, value in row.items():
            if key != "step" and value is not None:  # None: not finite in a skipped update
                live.log_metric(key, value, plot=True)
        live.next_step()

    return cb, live.end


def wandb_logger(params: Params) -> tuple[Logger | None, Callable[[], None] | None]:
    """A wandb run in ``train.wandb.mode`` (``WANDB_MODE`` overrides; ``(None, None)`` when
    disabled), resumed under the id kept in ``<train.output_dir>/wandb_run_id``."""
    cfg = params.train
    mode = os.environ.get("WANDB_MODE", cfg.wandb.mode)
    if mode == "disabled":
        return None, None
    import wandb

    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    id_file = Path(cfg.output_dir) / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    run = wandb.init(
        project=cfg.wandb.project,
        mode=mode,
        id=run_id,
        resume="allow",
        dir=cfg.output_dir,
        config=params.model_dump(),
    )

    def cb(row: dict) -> None:
        run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    return cb, run.finish


def step_loggers(params: Params) -> tuple[list[Logger], list[Callable[[], None]]]:
    """The per-step loggers (dvclive, and wandb unless disabled) and their close functions."""
    pairs = [(cb, close) for cb, close in (dvclive_logger(Path(params.train.metrics_dir)), wandb_logger(params))
             if cb is not None]
    return [cb for cb, _ in pairs], [close for _, close in pairs]
