"""Stage ``train``: GRPO on the (curriculum-ordered) training set; writes the adapter and metrics.

Outputs: ``models/adapter/`` (PEFT format), ``metrics/train.json`` (summary),
``metrics/train/`` (dvclive per-step metrics for ``dvc plots``), ``outputs/train/`` (checkpoints
and the per-step log; persistent, so a restarted stage resumes).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import uuid
from pathlib import Path

import torch

from grpo.base_model import load_tokenizer
from grpo.checkpoint import reset_if_changed
from grpo.config import Params
from grpo.device import default_device
from grpo.engine_policy import make_policy_backend
from grpo.jsonio import read_jsonl, write_json
from grpo.policy import load_policy
from grpo.trainer import GRPOTrainer
from tasks._common import run_stage

log = logging.getLogger(__name__)

SUMMARY_KEYS = ("reward_mean", "accuracy", "loss", "kl", "entropy_mean", "kept_frac", "step_time_s", "peak_mem_mb")


def _dvclive_callback(metrics_dir: Path):
    from dvclive import Live

    live = Live(dir=str(metrics_dir / "train"), dvcyaml=None, save_dvc_exp=False, report=None)

    def cb(row: dict) -> None:
        live.step = row["step"]
        for key, value in row.items():
            if key != "step":
                live.log_metric(key, value, plot=True)
        live.next_step()

    return cb, live.end


def _wandb_callback(params: Params):
    cfg = params.train
    mode = os.environ.get("WANDB_MODE", cfg.wandb_mode)
    if mode == "disabled":
        return None, None
    import wandb

    Path(cfg.output_dir).mkdir(parents=True, exist_ok=True)
    id_file = Path(cfg.output_dir) / "wandb_run_id"
    run_id = id_file.read_text().strip() if id_file.exists() else uuid.uuid4().hex[:8]
    id_file.write_text(run_id)
    run = wandb.init(
        project=cfg.wandb_project,
        mode=mode,
        id=run_id,
        resume="allow",
        dir=cfg.output_dir,
        config=params.model_dump(),
    )

    def cb(row: dict) -> None:
        run.log({k: v for k, v in row.items() if k != "step"}, step=row["step"])

    return cb, run.finish


def train(params: Params) -> None:
    cfg = params.train
    problems = read_jsonl(cfg.data_path)
    if not Path(params.model.path, "config.json").exists():
        raise FileNotFoundError(f"model.path: {params.model.path} has no config.json; run prepare_model first")
    adapter_dir, summary_path = Path(cfg.adapter_dir), Path(cfg.metrics_dir) / "train.json"
    shutil.rmtree(adapter_dir, ignore_errors=True)  # never leave a stale adapter that looks complete
    summary_path.unlink(missing_ok=True)

    reset_if_changed(params)  # a changed run starts afresh (grpo.checkpoint.fingerprint)
    torch.manual_seed(cfg.seed)
    device = default_device()
    tokenizer = load_tokenizer(params.model.path)
    model = load_policy(params.model, params.lora, device)
    callbacks, closers = [], []  # per-step loggers and their close functions
    for cb, close in (_dvclive_callback(Path(cfg.metrics_dir)), _wandb_callback(params)):
        if cb is not None:
            callbacks.append(cb)
            closers.append(close)
    val_problems = read_jsonl(cfg.val_path) if cfg.eval_every else None
    backend, backend_name = make_policy_backend(params, model, tokenizer)
    log.info("rollouts: %s", backend_name)
    trainer = GRPOTrainer(model, tokenizer, cfg, problems, backend=backend, callbacks=callbacks,
                          val_problems=val_problems)
    history = trainer.train(progress=True)

    tmp = adapter_dir.with_name(adapter_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    evals = [r for r in history if "val_accuracy" in r]
    if cfg.keep_best and trainer.best_dir.exists():
        shutil.copytree(trainer.best_dir, tmp)
    else:
        model.save_pretrained(tmp)
        write_json(tmp / "selection.json", {"adapter": "last step", "step": len(history),
                                            "val_accuracy": evals[-1]["val_accuracy"] if evals else None})
    tokenizer.save_pretrained(tmp)
    tmp.rename(adapter_dir)
    shutil.rmtree(Path(cfg.output_dir) / "engine", ignore_errors=True)  # the engine's copy of the base

    first, last = history[: min(10, len(history))], history[-min(10, len(history)) :]
    summary = {
        "steps": len(history),
        "rollout_backend": backend_name,
        **{f"final_{k}": history[-1][k] for k in SUMMARY_KEYS},
        "accuracy_first10": sum(r["accuracy"] for r in first) / len(first),
        "accuracy_last10": sum(r["accuracy"] for r in last) / len(last),
        "total_time_s": sum(r["step_time_s"] + r.get("time_validate_s", 0.0) for r in history),
        "adapter": json.loads((adapter_dir / "selection.json").read_text()),
    }
    if evals:
        best = max(evals, key=lambda r: r["val_accuracy"])  # the earliest of equals
        summary.update(final_val_accuracy=evals[-1]["val_accuracy"], best_val_accuracy=best["val_accuracy"],
                       best_val_step=best["step"])
    if "logp_mismatch_mean" in history[-1]:
        summary["logp_mismatch_mean"] = sum(r["logp_mismatch_mean"] for r in history) / len(history)
        summary["logp_mismatch_max"] = max(r["logp_mismatch_max"] for r in history)
    write_json(summary_path, summary)
    for close in closers:
        close()
    log.info("adapter written to %s; summary %s", adapter_dir, summary)


def main(argv: list[str] | None = None) -> int:
    return run_stage("train", train, argv)


if __name__ == "__main__":
    raise SystemExit(main())
