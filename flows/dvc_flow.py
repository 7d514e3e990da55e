"""The pipeline as a Prefect flow: each DVC stage is a Prefect task, DVC's state decides what runs.
Run it with ``python -m flows.pipeline`` (its command line, ``flows/pipeline.py``) or a deployment
(``flows/deploy.py``; entrypoint ``flows/dvc_flow.py:pipeline``).

The stages and their order are those of ``dvc.yaml`` (its ``stages:`` mapping, read at run time;
``--stages`` is checked against it). For each stage the flow asks DVC (``Repo.status``, what
``dvc status <stage>`` runs) whether its deps, params, outs or command differ from ``dvc.lock``: an unchanged stage is reported ``skipped``
and not started; a changed one runs as ``dvc repro --single-item <stage>`` in the workspace, its
output streamed into the Prefect log, and is reported ``ran`` (this includes outputs restored from
DVC's run cache). ``ran``/``skipped`` never depend on the wording of DVC's messages. Stages that
touch the network (``prepare_data`` may download GSM8K, ``prepare_model`` a hub model or the SmolLM2
wheel) are retried. With overrides, the params are set in ``params.yaml`` (comments kept; a
value the stages would refuse stops the flow before any stage, writing nothing), the stages run, and
``dvc exp save`` records the result as a named experiment. The report is published
as a markdown artifact, the metrics and the stage table as table artifacts, and ``main()`` (``flows/pipeline.py``) prints
one ``stage status seconds`` line per stage.

One DVC run at a time per workspace (``flows/workspace.py``). Before Prefect is even imported,
``main()`` looks for another DVC run in the workspace (a ``dvc repro``/``dvc exp run`` process, a live
PID in ``.dvc/tmp/rwlock``, a held ``.dvc/tmp/lock``) and takes the flow's own lock
``.dvc/tmp/grpo-flow.lock`` for the whole run; the flow function takes the same lock again
(re-entrant within the process), so a deployment calling the flow is protected too. A refused run
exits with status 2 and one stderr line ``flow: error: workspace ... is busy: PID ... (command) ...``,
having written nothing: no params override, no lock file, no DVC call. Before each stage the flow
checks again, so a ``dvc repro`` started meanwhile stops the flow with the same kind of line instead
of a DVC lock error. DVC itself writes outputs only after a stage succeeds, so a failed run never
leaves a half-written output recorded as complete.

Runs of a deployment (a worker's or ``python -m flows.deploy``'s) also queue per workspace on a Prefect
global concurrency limit named after the workspace's real path (``slot_name``: ``grpo-workspace-<hash>``,
1 slot, created on first use): the flow takes that slot first, waiting while another deployment run of
the same workspace holds it, and only then the workspace lock above. So a second scheduled run waits
for the first instead of failing as busy. A ``dvc repro`` or ``python -m flows.pipeline`` started by
hand takes no slot and still fails at once on a busy workspace, and a deployment run that finds such
a hand-started run there fails as before. ``GRPO_WORKSPACE_SLOT=off`` in the run's environment, or
the limit disabled on the server (``prefect gcl disable``), skips the slot.

A stage that runs longer than the flow's ``stage_timeout_s`` (default ``flows.workspace.STAGE_TIMEOUT_S``;
``--stage-timeout`` on the command line, ``stage_timeout_s`` in a deployment's parameters) is stopped,
its ``dvc repro`` and every process under it (``flows/process.py``), and fails its task and the flow
with one line, ``stage <name> (dvc repro --single-item <name>) timed out after <N> s: ...``; the flow
then lets go of the workspace lock and slot, so the next run gets the workspace. The task has Prefect's
own timeout too (the stage's plus ``TASK_SLACK_S``), a backstop over DVC's status check: when it fires,
the flow fails with the same kind of line, ``stage <name> timed out after <N> s: Prefect's task
timeout ...``. A timed-out stage is not retried.

Every stage runs with the flow's own interpreter directory first on ``PATH`` (``stage_env``), so
dvc.yaml's ``python -m tasks.<stage>`` is the environment's python whether or not it was activated.

Prefect's engines log every failure with its traceback. For the errors whose one line says it all
(``ONE_LINE_ERRORS``: a stage that failed, its own output already logged line by line; a stage past
its timeout; a busy workspace; params or a device the stages refuse) the flow's and tasks' loggers drop the traceback (``quiet_tracebacks``): the console and the
run's logs on the server show Prefect's one-line entries, and ``main()`` ends with ``flow: error:``
and the line.

``pipeline`` (the flow, entrypoint ``flows/dvc_flow.py:pipeline``) and ``run_stage`` (its task) are
decorated at module level. ``python -m flows.pipeline`` imports this module only once it holds the
workspace lock, so a refused run answers before Prefect is imported.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.task_engine import TaskRunTimeoutError

from flows.process import StageFailed, StageTimeout, run_logged
from flows.workspace import (
    STAGE_TIMEOUT_S,
    WorkspaceBusy,
    check_no_dvc_run,
    find_dvc_run,
    guard_stages,
    select_stages,
    stages_of,
    workspace_lock,
)
from grpo.core.errors import DeviceError, ParamsError
from grpo.rollout.engine.preflight import require_ready_gpu

NETWORK_STAGES = {"prepare_data", "prepare_model"}
SLOT_ENV = "GRPO_WORKSPACE_SLOT"  # "off" (or 0/false/no): deployment runs take no workspace slot
# The Prefect task's own timeout is the stage's plus this: a backstop over DVC's status check and the
# stop of the stage's processes, which the stage's timeout does not cover.
TASK_SLACK_S = 120.0


# Failures whose message is one complete line: Prefect logs them without a traceback (quiet_tracebacks).
ONE_LINE_ERRORS = (StageFailed, StageTimeout, TaskRunTimeoutError, WorkspaceBusy, ParamsError, DeviceError)
RUN_LOGGERS = ("prefect.flow_runs", "prefect.task_runs")  # the loggers of Prefect's flow and task engines


class _NoTraceback(logging.Filter):
    """Drops the traceback of a log record whose exception is one of ``ONE_LINE_ERRORS``; keeps the record."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], ONE_LINE_ERRORS):
            record.exc_info = record.exc_text = None
        return True


def quiet_tracebacks() -> None:
    """Prefect's flow and task engines log each failure with ``exc_info``: for ``ONE_LINE_ERRORS`` keep their
    one-line entries (console and server) without the traceback. Idempotent."""
    for name in RUN_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _NoTraceback) for f in logger.filters):
            logger.addFilter(_NoTraceback())


def _dvc() -> list[str]:
    return [sys.executable, "-m", "dvc"]


def stage_env() -> dict[str, str]:
    """This process's environment with its interpreter's directory first on ``PATH``: the ``python`` of
    dvc.yaml's commands (``python -m tasks.<stage>``) and every tool a stage starts come from the
    environment the flow runs in, activated or not (a worker started as ``<venv>/bin/prefect``, a
    systemd unit, a cron line)."""
    env = dict(os.environ)
    bindir = str(Path(sys.executable).parent)
    rest = [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir]
    env["PATH"] = os.pathsep.join([bindir, *rest])
    return env


quiet_tracebacks()


def stage_changed(root: Path, stage: str) -> bool:
    """Whether DVC would reproduce ``stage``: its deps, params, outs or cmd differ from dvc.lock."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return bool(repo.status(targets=[f"{root / 'dvc.yaml'}:{stage}"]))


@task(name="dvc-stage", task_run_name="{stage}", timeout_seconds=STAGE_TIMEOUT_S + TASK_SLACK_S)
def run_stage(stage: str, workdir: str, timeout_s: float = STAGE_TIMEOUT_S) -> dict:
    """Skip ``stage`` if DVC finds it unchanged, else ``dvc repro --single-item <stage>`` with its output logged.

    A run past ``timeout_s`` seconds stops that ``dvc repro`` and every process under it and raises
    ``StageTimeout`` (one line naming the stage and the timeout); a failed ``dvc repro`` raises
    ``WorkspaceBusy`` when another DVC run is the likely cause, else ``RuntimeError`` with its last lines.
    """
    logger = get_run_logger()
    root = Path(workdir)
    t0 = time.perf_counter()
    try:
        changed = stage_changed(root, stage)  # takes DVC's locks for a moment, like `dvc status`
    except Exception as err:
        other = find_dvc_run(root)  # DVC's LockError when a DVC run started beside the flow: name it
        if other is not None:
            raise WorkspaceBusy(f"stage {stage}: {other.message(root)}") from err
        raise
    if not changed:
        logger.info("stage %s: unchanged since dvc.lock (dvc status), skipped", stage)
        return {"stage": stage, "status": "skipped", "seconds": round(time.perf_counter() - t0, 1)}
    try:
        code, lines = run_logged([*_dvc(), "repro", "--single-item", stage], root, timeout_s, logger.info,
                                 what=f"stage {stage} (dvc repro --single-item {stage})", env=stage_env())
    except StageTimeout as err:
        raise StageTimeout(f"{err}; the limit is the flow's stage_timeout_s (python -m flows.pipeline "
                           "--stage-timeout SECONDS)") from None
    if code != 0:
        other = find_dvc_run(root)  # a DVC run started beside the flow is the likely cause: name it
        if other is not None:
            raise WorkspaceBusy(f"stage {stage}: {other.message(root)}")
        raise StageFailed(f"stage {stage} failed: dvc repro --single-item {stage} exited with {code} (its output "
                          "is the log above)")
    return {"stage": stage, "status": "ran", "seconds": round(time.perf_counter() - t0, 1)}


def _retry_unless_busy(task, task_run, state) -> bool:
    """Retry a failed network stage, but not one that failed because another DVC run holds the workspace,
    nor one that ran past its timeout or Prefect's (a retry would hold the workspace that long again)."""
    return not isinstance(getattr(state, "data", None), (WorkspaceBusy, StageTimeout, TaskRunTimeoutError))


def slot_name(workdir: str | Path) -> str:
    """The Prefect global concurrency limit of a workspace: ``grpo-workspace-`` and a hash of its real path."""
    return "grpo-workspace-" + hashlib.sha256(str(Path(workdir).resolve()).encode()).hexdigest()[:12]


def _deployment_run():
    """The current flow run when it is a deployment's run and ``GRPO_WORKSPACE_SLOT`` is not off, else None."""
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    run = ctx.flow_run if ctx is not None else None
    off = os.environ.get(SLOT_ENV, "").strip().lower() in ("0", "off", "false", "no")
    return run if run is not None and run.deployment_id is not None and not off else None


@contextlib.contextmanager
def workspace_slot(root: Path):
    """In a deployment run: hold the workspace's 1-slot Prefect concurrency limit (created if missing), waiting
    while another run holds it. Outside a deployment (a run by hand), or with ``GRPO_WORKSPACE_SLOT=off``: nothing.
    """
    run = _deployment_run()
    if run is None:
        yield None
        return
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
    from prefect.client.schemas.objects import ConcurrencyLeaseHolder
    from prefect.concurrency.sync import concurrency
    from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

    logger = get_run_logger()
    name = slot_name(root)
    t0 = time.monotonic()
    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            limit = None
            with contextlib.suppress(ObjectAlreadyExists):  # another run created it just now
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
                logger.info("created the global concurrency limit %s (1 slot) for workspace %s", name, root)
    if limit is not None and not limit.active:
        logger.warning("the global concurrency limit %s of workspace %s is disabled: not waiting for a slot", name, root)
        yield None
        return
    if limit is not None and limit.active_slots >= limit.limit:
        logger.info("workspace %s: another run holds its slot %s; waiting for the slot", root, name)
    # the slot is leased: renewed while the flow runs, freed by the server if this process dies
    with concurrency(name, occupy=1, raise_on_lease_renewal_failure=False,
                     holder=ConcurrencyLeaseHolder(type="flow_run", id=run.id)):
        logger.info("took the workspace slot %s after %.1f s", name, time.monotonic() - t0)
        yield name


def apply_overrides(params_path: Path, overrides: dict[str, str]) -> None:
    """Set dotted keys (``train.optimizer.lr=5e-4``; a string value is read as YAML) in params.yaml, keeping its
    comments (``grpo.config.reading.write_params``); a result the stages would refuse writes nothing and raises
    ``ParamsError`` naming the key."""
    from flows.overrides import override_values, refusal
    from grpo.config.params import write_params

    try:
        write_params(params_path, override_values(overrides))
    except ParamsError as err:
        raise refusal(params_path, overrides, err) from None


def _publish(workdir: Path, results: list[dict]) -> None:
    """The report (its PNGs inlined: the artifact is one piece of markdown), the accuracies and the stage
    table as Prefect artifacts of the flow run."""
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    from grpo.evaluation.report import inline_images

    report = workdir / "reports" / "report.md"
    if report.exists():
        create_markdown_artifact(inline_images(report.read_text(), report.parent), key="grpo-report",
                                 description="GRPO run report")
    rows = []
    for name in ("baseline", "final"):
        path = workdir / "metrics" / f"{name}.json"
        if path.exists():
            m = json.loads(path.read_text())
            rows.append({"split": name, "accuracy": round(m["accuracy"], 4), "format_rate": round(m["format_rate"], 4),
                         "n": m["n"]})
    if rows:
        create_table_artifact(rows, key="grpo-metrics", description="Greedy test accuracy")
    create_table_artifact(results, key="grpo-stages", description="Stages run or skipped by DVC")


@flow(name="grpo-pipeline", log_prints=True)
def pipeline(workdir: str = ".", overrides: dict[str, str] | None = None, experiment_name: str | None = None,
             stages: list[str] | None = None, stage_timeout_s: float = STAGE_TIMEOUT_S) -> list[dict]:
    """Run the DVC stages in dvc.yaml's order as Prefect tasks; with ``overrides``, record a DVC experiment.

    Each stage's ``dvc repro`` is stopped, its processes with it, after ``stage_timeout_s`` seconds; the
    flow then fails with the ``StageTimeout`` line and lets go of the workspace (its lock and slot).
    """
    quiet_tracebacks()
    logger = get_run_logger()
    root = Path(workdir).resolve()
    selected = select_stages(stages_of(root), stages, guard_stages(root))  # the params check first, always
    # the workspace's Prefect slot first (deployment runs only), so a second deployment run waits there for the
    # first instead of failing on the lock; the lock is re-entrant: main() already holds it, a deployment takes it here
    with workspace_slot(root), workspace_lock(root):
        require_ready_gpu()  # grpo doctor's blockers (a CPU machine: nothing), before any stage starts
        if overrides:
            apply_overrides(root / "params.yaml", overrides)
            logger.info("params overridden: %s", overrides)
        results = []
        for stage in selected:
            check_no_dvc_run(root)  # a `dvc repro` started beside the flow since the last stage
            task_limit = stage_timeout_s + TASK_SLACK_S
            runner = run_stage.with_options(timeout_seconds=task_limit)
            if stage in NETWORK_STAGES:
                runner = runner.with_options(retries=2, retry_delay_seconds=10, retry_condition_fn=_retry_unless_busy)
            try:
                results.append(runner(stage, str(root), stage_timeout_s))
            except TaskRunTimeoutError:  # the backstop fired (DVC's status check hung): the same one line
                raise StageTimeout(f"stage {stage} timed out after {task_limit:g} s: Prefect's task timeout (the "
                                   f"flow's stage_timeout_s + {TASK_SLACK_S:g} s) stopped it; the limit is the flow's "
                                   "stage_timeout_s (python -m flows.pipeline --stage-timeout SECONDS)") from None
        if overrides or experiment_name:
            cmd = [*_dvc(), "exp", "save", "--force"] + (["--name", experiment_name] if experiment_name else [])
            subprocess.run(cmd, cwd=root, check=True, env=stage_env())
            logger.info("recorded as DVC experiment %s", experiment_name or "(auto-named)")
        _publish(root, results)
    return results
