"""Serve the pipeline flow on the cron of ``flows/schedule.yaml`` (a real Prefect server is needed:
the ephemeral one refuses schedules).

    prefect server start &                                   # UI and API on http://127.0.0.1:4200
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m flows.deploy [--config flows/schedule.yaml]    # registers the deployment, runs it on schedule

The process keeps serving: it polls the server and executes each scheduled run in this workspace.
Watch runs with ``prefect flow-run ls`` or the UI; trigger one now with
``prefect deployment run 'grpo-pipeline/grpo-nightly'``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from flows.pipeline import pipeline

KEYS = {"name", "cron", "timezone", "parameters"}


def load_schedule(path: str | Path) -> dict:
    """The deployment config; unknown keys or a missing cron fail with a line naming them."""
    path = Path(path)
    if not path.exists():
        raise SystemExit(f"deploy: error: {path}: schedule config not found")
    cfg = yaml.safe_load(path.read_text()) or {}
    unknown = set(cfg) - KEYS
    if unknown:
        raise SystemExit(f"deploy: error: {path}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(KEYS))}")
    if not cfg.get("cron"):
        raise SystemExit(f"deploy: error: {path}: 'cron' is required (e.g. \"0 3 * * *\")")
    return cfg


def build_deployment(cfg: dict):
    from prefect.schedules import Cron

    return pipeline.to_deployment(
        name=cfg.get("name", "grpo-scheduled"),
        schedule=Cron(cfg["cron"], timezone=cfg.get("timezone", "UTC")),
        parameters=cfg.get("parameters") or {},
        description="The GRPO DVC pipeline on a cron",
    )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="flows/schedule.yaml")
    args = ap.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        raise SystemExit("deploy: error: PREFECT_API_URL is not set; start `prefect server start` and export "
                         "PREFECT_API_URL=http://127.0.0.1:4200/api (schedules need a real server)")
    from prefect import serve

    serve(build_deployment(load_schedule(args.config)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
