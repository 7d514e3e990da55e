"""Stage ``train``: GRPO on the (curriculum-ordered) training set; writes the adapter and metrics.

Outputs: ``models/adapter/`` (PEFT format), ``metrics/train.json`` (summary),
``metrics/train/`` (dvclive per-step metrics for ``dvc plots``), ``outputs/train/`` (checkpoints
and the per-step log; persistent, so a restarted stage resumes). The adapter and the summary are
replaced only once a run has completed (``RunDir.ship``, ``grpo.jsonio.write_json``): a run that
fails or is interrupted leaves the last completed run's in place; Ctrl-C ends the stage with one
line saying so and naming the checkpoint a rerun resumes from (exit code 130).

With ``train.num_processes`` N > 1 the stage launches N copies of itself on this machine through
torch.distributed's launcher (``elastic_launch``, what ``torchrun --standalone`` runs), waits for
them and exits with their status: a process that fails stops the others, and the stage prints one
line naming its rank and exit code; a process that hangs (alive, but not at the collective the
others wait in) makes them time out after ``train.dist_timeout_s``, and the line names it (exit
code ``grpo.distributed.TIMEOUT_EXIT_CODE``). A process started by a launcher (``WORLD_SIZE``
set: this stage's own launch, or ``torchrun`` / ``accelerate launch`` of ``-m tasks.train``, also
across machines) joins the process group instead (``grpo.distributed``); rank 0 alone writes the
outputs. With engine rollouts every process holds its own engine (``grpo.engine.policy_engine``); on
a CPU their N shares of RAM are checked before launching (``grpo.engine.policy_engine.check_engine_memory``).
"""

from __future__ import annotations

import functools
import logging
import os
import shutil
import signal
import sys
import uuid
from pathlib import Path

import torch

from grpo.base_model import check_model_dir, load_tokenizer
from grpo.checkpoint import reset_if_changed
from grpo.config import Params, ParamsError
from grpo.data import prompts_that_fit
from grpo.device import compute_dtype, default_device
from grpo.distributed import (
    LAUNCHER_PID,
    TIMEOUT_EXIT_CODE,
    CollectiveTimeout,
    Dist,
    die_with_parent,
    init_from_env,
    launched,
    shutdown,
    writes_outputs,
)
from grpo.engine.bounds import train_bounds
from grpo.engine.forms import rollouts_per_process
from grpo.engine.policy_engine import check_engine_memory, policy_rollouts
from grpo.jsonio import read_jsonl, write_json
from grpo.lora_policy import load_policy
from grpo.memory import form_here
from grpo.rollout_backends import uses_engine
from grpo.run_dir import RunDir
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
            if key != "step" and value is not None:  # None: not finite in a skipped update
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


def _loggers(params: Params) -> tuple[list, list]:
    """The per-step loggers (dvclive, and wandb unless disabled) and their close functions."""
    pairs = [(cb, close) for cb, close in (_dvclive_callback(Path(params.train.metrics_dir)), _wandb_callback(params))
             if cb is not None]
    return [cb for cb, _ in pairs], [close for _, close in pairs]


class LaunchFailed(Exception):
    """A training process of a multi-process launch failed (the message names its rank); ``code``:
    its exit code (1 when a signal ended it)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def launch_processes(n: int, argv: list[str], timeout_s: float) -> None:
    """Run ``python -m tasks.train *argv`` as ``n`` data-parallel processes on this machine through
    torch.distributed's launcher (``torchrun --standalone --nproc-per-node n``: a c10d rendezvous
    on a free local port, no restarts) and wait for them. A process that fails makes the launcher
    stop the others (SIGTERM; SIGKILL after torch's 30 s grace: a frozen process ignores SIGTERM);
    ``LaunchFailed`` then names its rank and exit code, or, when it timed out in a collective
    (``timeout_s``, the workers' ``train.dist_timeout_s``), the ranks that were still running: the
    ones that hang. Each process gets ``cores / n`` threads unless ``OMP_NUM_THREADS`` is set."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // n)))
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers die with this process (die_with_parent)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    log.info("launching %d training processes (torch.distributed, c10d rendezvous on localhost)", n)
    try:
        elastic_launch(config, sys.executable)("-m", "tasks.train", *argv)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1
        if failure.exitcode == TIMEOUT_EXIT_CODE:
            stopped = (-signal.SIGTERM, -signal.SIGKILL)  # the launcher's: these were still running
            hung = sorted(r for r, f in err.failures.items() if r != rank and f.exitcode in stopped)
            if hung:
                names = ", ".join(map(str, hung))
                raise LaunchFailed(f"training process rank {names} hung: rank {rank} timed out waiting for it in a "
                                   f"collective (train.dist_timeout_s = {timeout_s:g} s); the launcher stopped "
                                   f"every process", code) from None
            raise LaunchFailed(f"training process rank {rank} timed out in a collective (train.dist_timeout_s = "
                               f"{timeout_s:g} s) and no process was left running; see their output above",
                               code) from None
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        raise LaunchFailed(f"training process rank {rank} failed ({how}); the launcher stopped the other "
                           f"{n - 1} process(es); see rank {rank}'s output above", code) from None


def train(params: Params, argv: list[str] = ()) -> None:
    cfg = params.train
    if cfg.num_processes > 1 and not launched():
        if uses_engine(cfg.rollout_backend) and default_device() == "cpu":
            check_engine_memory(cfg.gpu_memory_utilization, cfg.num_processes)  # before any process starts
        launch_processes(cfg.num_processes, list(argv), cfg.dist_timeout_s)
        return
    if launched():
        die_with_parent()
    device = default_device()
    dist = init_from_env(device, cfg.dist_timeout_s)
    try:
        _train(params, dist, device)
    except KeyboardInterrupt:
        raise Interrupted(interrupted_line(params)) from None
    finally:
        shutdown(dist)


class Interrupted(Exception):
    """The stage was interrupted (Ctrl-C); the message is one line saying what was kept."""


def interrupted_line(params: Params) -> str:
    """What an interrupted run left: the shipped adapter and summary untouched, and the newest
    checkpoint the next run resumes from (when the params and data keep their fingerprint)."""
    cfg = params.train
    ckpt = RunDir(cfg.output_dir, cfg.keep_best).latest_checkpoint()
    resume = f"rerun to resume from {ckpt}" if ckpt else f"no checkpoint yet in {cfg.output_dir}: a rerun starts at step 0"
    return (f"interrupted; {cfg.adapter_dir} and {Path(cfg.metrics_dir) / 'train.json'} are unchanged (the last "
            f"completed run's, if any); {resume}")


def _train(params: Params, dist: Dist, device: str) -> None:
    """The stage's work in one process of ``dist`` (rank 0 writes every output)."""
    cfg = params.train
    cfg.check_split(dist.world_size)
    if os.environ.get("ACCELERATE_USE_DEEPSPEED") == "true" and not cfg.deepspeed_config:
        ds_file = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE", "its DeepSpeed JSON")
        raise ParamsError(f"train.deepspeed_config is empty but accelerate launched a DeepSpeed run: set it to "
                          f"{ds_file} (the trainer reads the JSON from the param; without it the run is plain "
                          "data parallelism)")
    problems = read_jsonl(cfg.data_path)
    check_model_dir(params.model.path)
    adapter_dir, summary_path = Path(cfg.adapter_dir), Path(cfg.metrics_dir) / "train.json"
    if dist.is_main:  # the shipped adapter and summary stay until new ones replace them (RunDir.ship)
        reset_if_changed(params)  # a changed run starts afresh (grpo.checkpoint.fingerprint)
    torch.manual_seed(cfg.seed)
    if dist.active and device == "cuda":
        device = f"cuda:{dist.local_rank}"
    tokenizer = load_tokenizer(params.model.path)
    problems, _ = prompts_that_fit(tokenizer, problems, cfg.system_prompt, cfg, cfg.data_path)
    model = load_policy(params.model, params.lora, device)
    callbacks, closers = _loggers(params) if dist.is_main else ([], [])
    val_problems = read_jsonl(cfg.val_path) if cfg.eval_every else None
    bounds = train_bounds(cfg, model.config, device, compute_dtype(params.model.dtype, device).itemsize,
                          dist.world_size)
    backend = policy_rollouts(cfg.rollout_backend, tokenizer, model, section=cfg, engine_dir=Path(cfg.output_dir) / "engine",
                              base=params.model, form=form_here(params, Path("."), device)[0], bounds=bounds,
                              seed=cfg.seed, dtype=params.model.dtype, dist=dist)
    weights_form = getattr(backend, "weights_form", None)  # None: no engine (the decode loop)
    rollouts = rollouts_per_process(weights_form is not None, dist.world_size, weights_form)
    log.info("rollouts: %s (rank %d of %d)", rollouts, dist.rank, dist.world_size)
    trainer = GRPOTrainer(model, tokenizer, cfg, problems, backend=backend, callbacks=callbacks,
                          val_problems=val_problems, dist=dist)
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
    log.info("adapter written to %s; summary %s", adapter_dir, summary)


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
        "accuracy_first10": sum(r["accuracy"] for r in first) / len(first),
        "accuracy_last10": sum(r["accuracy"] for r in last) / len(last),
        "total_time_s": sum(r["step_time_s"] + r.get("time_validate_s", 0.0) for r in history),
        "adapter": selection,
    }
    evals = [r for r in history if "val_accuracy" in r]
    if evals:
        best = max(evals, key=lambda r: r["val_accuracy"])  # the earliest of equals
        summary.update(final_val_accuracy=evals[-1]["val_accuracy"], best_val_accuracy=best["val_accuracy"],
                       best_val_step=best["step"])
    gaps = [r for r in history if r.get("logp_mismatch_mean") is not None]  # None: a step not applied
    if gaps:
        summary["logp_mismatch_mean"] = sum(r["logp_mismatch_mean"] for r in gaps) / len(gaps)
        summary["logp_mismatch_max"] = max(r["logp_mismatch_max"] for r in gaps)
    return summary


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run_stage("train", functools.partial(train, argv=argv), argv, writes=writes_outputs())
    except Interrupted as err:
        print(f"train: {err}", file=sys.stderr)
        return 130  # the shell's code for a command ended by SIGINT
    except LaunchFailed as err:
        print(f"train: error: {err}", file=sys.stderr)
        return err.code
    except CollectiveTimeout as err:  # in a worker (the launcher names the rank that hangs)
        print(f"train: error: {err}", file=sys.stderr)
        return TIMEOUT_EXIT_CODE


if __name__ == "__main__":
    raise SystemExit(main())
