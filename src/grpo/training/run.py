"""Training as a whole: ``run(params)`` does GRPO on the (curriculum-ordered) training set and
writes the adapter and metrics; the train stage (``python -m tasks.train``) is this call.

Outputs: ``models/adapter/`` (PEFT format), ``metrics/train.json`` (summary),
``metrics/train/`` (dvclive per-step metrics for ``dvc plots``, ``grpo.training.step_loggers``),
``outputs/train/`` (checkpoints and the per-step log; persistent, so a restarted run resumes). The
adapter and the summary are replaced only once a run has completed (``RunDir.ship``,
``grpo.core.jsonio.write_json``): a run that fails or is interrupted leaves the last completed run's in
place; Ctrl-C raises ``Interrupted``, one line saying so and naming the checkpoint a rerun resumes
from (the stage prints it and exits with code 130).

With ``train.distribution.num_processes`` N > 1 the run launches N worker processes on this machine through
torch.distributed's launcher (``grpo.training.launcher``: ``elastic_launch``, what ``torchrun
--standalone`` runs; the stage's workers are ``python -m tasks.train`` again), waits for them and
ends with their status: a process that fails stops the others, and ``LaunchFailed`` names its rank
and exit code; a process that hangs (alive, but not at the collective the others wait in) makes
them time out after ``train.distribution.dist_timeout_s`` (each raises ``grpo.core.distributed.CollectiveTimeout``,
exit code ``grpo.core.distributed.TIMEOUT_EXIT_CODE`` in the stage), and ``LaunchFailed`` names it. A
process started by a launcher (``WORLD_SIZE`` set: the run's own launch, or ``torchrun`` /
``accelerate launch`` of ``-m tasks.train``, also across machines) joins the process group
instead (``grpo.core.distributed``); rank 0 alone writes the outputs. With engine rollouts every process
holds its own engine (``grpo.rollout.engine.policy_engine``); on a CPU their N shares of RAM are checked
before launching (``grpo.rollout.engine.policy_engine.check_engine_memory``).
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Sequence
from pathlib import Path

from grpo.config.reading import Params, ParamsError
from grpo.config.sections.train import check_across_sections
from grpo.core.device import default_device, make_deterministic
from grpo.core.distributed import Dist, die_with_parent, init_from_env, launched, shutdown
from grpo.core.jsonio import read_jsonl, write_json
from grpo.model.base_model import check_model_dir
from grpo.rollout.engine.policy_engine import check_engine_memory
from grpo.rollout.rollout_backends import uses_engine
from grpo.training.checkpoint import reset_if_changed
from grpo.training.launcher import launch_processes
from grpo.training.run_dir import RunDir
from grpo.training.step_loggers import step_loggers
from grpo.training.trainer_builder import build_trainer

log = logging.getLogger(__name__)

SUMMARY_KEYS = ("reward_mean", "rollout_accuracy", "loss", "kl", "entropy_mean", "kept_frac", "step_time_s", "peak_mem_mb")


class Interrupted(Exception):
    """The run was interrupted (Ctrl-C); the message is one line saying what was kept."""


def run(params: Params, worker: Sequence[str] | None = None) -> None:
    """Train with ``params`` in this process, or, with ``train.distribution.num_processes`` N > 1 in a process
    no launcher started, in N launched processes of ``python *worker`` (the stage's: ``-m
    tasks.train --params FILE``: each loads the same params and calls ``run``), waiting for them
    (``grpo.training.launcher.LaunchFailed`` when one fails). Raises ``Interrupted`` on Ctrl-C."""
    cfg = check_across_sections(params).train
    if cfg.distribution.num_processes > 1 and not launched():
        if worker is None:
            raise ValueError(f"train.distribution.num_processes is {cfg.distribution.num_processes}: run() needs `worker`, the python "
                             "arguments that start one training process (e.g. -m tasks.train --params FILE)")
        if uses_engine(cfg.rollouts.backend) and default_device() == "cpu":
            check_engine_memory(cfg.rollouts.gpu_memory_utilization, cfg.distribution.num_processes)  # before any process starts
        launch_processes(cfg.distribution.num_processes, list(worker), cfg.distribution.dist_timeout_s)
        return
    if launched():
        die_with_parent()
    if cfg.deterministic:  # before the first CUDA matmul: cuBLAS reads its workspace setting at start
        log.info("train.deterministic: torch's deterministic algorithms on, CUBLAS_WORKSPACE_CONFIG=%s",
                 make_deterministic())
    device = default_device()
    dist = init_from_env(device, cfg.distribution.dist_timeout_s)
    try:
        _train(params, dist, device)
    except KeyboardInterrupt:
        raise Interrupted(interrupted_line(params)) from None
    finally:
        shutdown(dist)


def interrupted_line(params: Params) -> str:
    """What an interrupted run left: the shipped adapter and summary untouched, and the newest
    checkpoint the next run resumes from (when the params and data keep their fingerprint)."""
    cfg = params.train
    ckpt = RunDir(cfg.output_dir, cfg.checkpoints.keep_best).latest_checkpoint()
    resume = f"rerun to resume from {ckpt}" if ckpt else f"no checkpoint yet in {cfg.output_dir}: a rerun starts at step 0"
    return (f"interrupted; {cfg.adapter_dir} and {Path(cfg.metrics_dir) / 'train.json'} are unchanged (the last "
            f"completed run's, if any); {resume}")


def _train(params: Params, dist: Dist, device: str) -> None:
    """The run's work in one process of ``dist`` (rank 0 writes every output)."""
    cfg = params.train
    cfg.check_split(dist.world_size)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and not cfg.distribution.deepspeed_config:
        ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "its DeepSpeed JSON")
        raise ParamsError(f"train.distribution.deepspeed_config is empty but accelerate launched a DeepSpeed run: set it to "
                          f"{ds_file} (the trainer reads the JSON from the param; without it the run is plain "
                          "data parallelism)")
    problems = read_jsonl(cfg.data_path)
    check_model_dir(params.model.path)
    adapter_dir, summary_path = Path(cfg.adapter_dir), Path(cfg.metrics_dir) / "train.json"
    if dist.is_main:  # the shipped adapter and summary stay until new ones replace them (RunDir.ship)
        reset_if_changed(params)  # a changed run starts afresh (grpo.training.checkpoint.fingerprint)
    if dist.active and device == "cuda":
        device = f"cuda:{dist.local_rank}"
    val_problems = read_jsonl(cfg.checkpoints.val_path) if cfg.checkpoints.eval_every else None
    built = build_trainer(params, device, problems=problems, dist=dist, val_problems=val_problems,
                          loggers=(lambda: step_loggers(params)) if dist.is_main else None)
    trainer, model, tokenizer, backend = built.trainer, built.model, built.tokenizer, built.backend
    weights_form, rollouts, closers = built.weights_form, built.rollouts, built.closers
    log.info("rollouts: %s (rank %d of %d)", rollouts, dist.rank, dist.world_size)
    try:
        history = trainer.train(progress=True)
        dist.barrier()  # closing an engine ends torch.distributed's group: after every rank's last collective
    finally:
        backend.close()  # the engine and its memory are given back before the adapter is written
    if not dist.is_main:
        return

    selection = trainer.run.ship(adapter_dir, model, tokenizer, history)
    shutil.rmtree(Path(cfg.output_dir) / "engine", ignore_errors=True)  # the engine's copy of the base

    summary = {**train_summary(history, backend.name, dist.world_size, selection, weights_form), "rollouts": rollouts}
    write_json(summary_path, summary)
    for close in closers:
        close()
    log.info("%s", summary_line(summary, adapter_dir, summary_path))


def summary_line(summary: dict, adapter_dir, summary_path) -> str:
    """The train stage's last line: steps, time, rollout accuracy first and last ten steps, the
    last validation with its interval, where the adapter and the whole summary are."""
    val = ""
    if "final_val_accuracy" in summary:
        ci = (f" [{summary['final_val_ci_low']:.3f}, {summary['final_val_ci_high']:.3f}]"
              if "final_val_ci_low" in summary else "")
        val = f", validation {summary['final_val_accuracy']:.3f}{ci}"
    return (f"done: {summary['steps']} steps in {summary['total_time_s']:.0f} s, rollout accuracy "
            f"{summary['rollout_accuracy_first10']:.3f} -> {summary['rollout_accuracy_last10']:.3f} (first/last 10 steps)"
            f"{val}; adapter {adapter_dir}, the rest in {summary_path}")


def acting(history: list[dict]) -> dict:
    """Whether the method's parts acted over the run: the mean per step of the fraction of tokens
    whose clip bound (``clip_frac``) and the steps where it bound at all; with a KL term, the mean
    of its gradient's share (``kl_grad_share``); where the token-entropy rule acted
    (``grpo.training.metrics.rule_action_row``): the mean per step of archer's wider-clip tokens in the band
    beyond the ordinary clip and of their share of the policy gradient, and of the kept tokens'
    share (a rule that drops tokens); the clip and the band over the tokens where they can act
    (``clip_frac_acting``, ``wide_band_frac_acting``), the kept fraction of the valid tokens
    (``kept_frac``: ``high``'s kept share) and the update's share of rows of zero advantage
    (``zero_adv_update_frac``). A step without the statistic is left out."""
    out = {}
    clips = [r["clip_frac"] for r in history if r.get("clip_frac") is not None]
    if clips:
        out.update(mean_clip_frac=sum(clips) / len(clips), clip_bound_steps=sum(c > 0 for c in clips))
    shares = [r["kl_grad_share"] for r in history if r.get("kl_grad_share") is not None]
    if shares:
        out["mean_kl_grad_share"] = sum(shares) / len(shares)
    for key in ("wide_band_frac", "wide_band_grad_share", "kept_grad_share", "clip_frac_acting",
                "wide_band_frac_acting", "kept_frac", "zero_adv_update_frac"):
        values = [r[key] for r in history if r.get(key) is not None]
        if values:
            out[f"mean_{key}"] = sum(values) / len(values)
    return out


def train_summary(history: list[dict], backend: str, processes: int, selection: dict,
                  engine_weights: str | None = None) -> dict:
    """``metrics/train.json``: the run's shape (with engine rollouts, the engine's weights form:
    ``dense`` or ``adapter``), the last step's ``SUMMARY_KEYS``, accuracy over the
    first and last ten steps, the total time, the shipped adapter, the validation summary and, with
    engine rollouts, the sampler/trainer log-prob gap."""
    first, last = history[: min(10, len(history))], history[-min(10, len(history)) :]
    summary = {
        "steps": len(history),
        "rollout_backend": backend,
        "engine_weights": engine_weights,
        "num_processes": processes,
        **{f"final_{k}": history[-1][k] for k in SUMMARY_KEYS},
        "rollout_accuracy_first10": sum(r["rollout_accuracy"] for r in first) / len(first),
        "rollout_accuracy_last10": sum(r["rollout_accuracy"] for r in last) / len(last),
        "total_time_s": sum(r["step_time_s"] + r.get("time_validate_s", 0.0) for r in history),
        "adapter": selection,
    }
    evals = [r for r in history if "val_accuracy" in r]
    if evals:
        best = max(evals, key=lambda r: r["val_accuracy"])  # the earliest of equals
        summary.update(final_val_accuracy=evals[-1]["val_accuracy"], best_val_accuracy=best["val_accuracy"],
                       best_val_step=best["step"])
        # the last validation's interval that counts a problem once (grpo.training.trainer.validation_interval)
        summary.update({f"final_{k}": evals[-1][k] for k in ("val_ci_low", "val_ci_high", "val_clusters",
                                                              "val_effective_n") if k in evals[-1]})
    summary.update(acting(history))
    gaps = [r for r in history if r.get("logp_mismatch_mean") is not None]  # None: a step not applied
    if gaps:
        summary["logp_mismatch_mean"] = sum(r["logp_mismatch_mean"] for r in gaps) / len(gaps)
        summary["logp_mismatch_max"] = max(r["logp_mismatch_max"] for r in gaps)
    return summary
