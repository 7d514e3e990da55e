"""Deploy the pipeline flow on the cron of ``flows/schedule.yaml`` (a real Prefect server is needed:
the ephemeral one refuses schedules).

    prefect server start &                                   # UI and API on http://127.0.0.1:4200
    export PREFECT_API_URL=http://127.0.0.1:4200/api
    python -m flows.deploy [--config flows/schedule.yaml]    # registers the deployment, runs it on schedule

Without ``--pool`` the process keeps serving: it polls the server and executes each scheduled run in
this workspace. With ``--pool`` it registers the deployment on a work pool and ends; a worker of that
pool, here or on another machine, runs the scheduled runs:

    prefect work-pool create grpo-pool --type process        # once per server
    python -m flows.deploy --pool grpo-pool                  # code and workspace: this checkout
    prefect worker start --pool grpo-pool                    # on the machine holding this checkout

The deployment's source is the checkout holding this file: each run starts in that directory
(a ``set_working_directory`` pull step) and runs ``flows/dvc_flow.py:pipeline`` with
``workdir: "."``, so it is the DVC workspace too. Runs of one workspace queue on its Prefect
concurrency slot (``flows/dvc_flow.py``): a run due while another runs waits, then runs.

Watch runs with ``prefect flow-run ls`` or the UI; trigger one now with
``prefect deployment run 'grpo-pipeline/grpo-nightly'``.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import yaml

from flows.dvc_flow import pipeline
from flows.server_auth import ALLOW_FLAG, check_api_auth

KEYS = {"name", "cron", "timezone", "parameters"}
ROOT = Path(__file__).resolve().parents[1]  # the checkout holding this file: the flow's code and workspace
ENTRYPOINT = "flows/dvc_flow.py:pipeline"


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


def _schedule(cfg: dict):
    from prefect.schedules import Cron

    return Cron(cfg["cron"], timezone=cfg.get("timezone", "UTC"))


def build_deployment(cfg: dict):
    """The deployment this process serves (no work pool)."""
    return pipeline.to_deployment(
        name=cfg.get("name", "grpo-scheduled"),
        schedule=_schedule(cfg),
        parameters=cfg.get("parameters") or {},
        description="The GRPO DVC pipeline on a cron",
    )


def deploy_to_pool(cfg: dict, pool: str, source: str | Path = ROOT):
    """Register the deployment on the work pool ``pool``, its code and working directory ``source``; its id."""
    flow = pipeline.from_source(source=str(source), entrypoint=ENTRYPOINT)
    try:
        return flow.deploy(
            name=cfg.get("name", "grpo-scheduled"),
            work_pool_name=pool,
            schedule=_schedule(cfg),
            parameters=cfg.get("parameters") or {},
            description=f"The GRPO DVC pipeline on a cron, run by a worker of {pool} in {source}",
            print_next_steps=False,
            ignore_warnings=True,
        )
    except ValueError as err:
        if "Could not find work pool" in str(err):
            raise SystemExit(f"deploy: error: no work pool {pool!r} on the server; create it with "
                             f"`prefect work-pool create {pool} --type process`") from err
        raise


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m flows.deploy", description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="flows/schedule.yaml")
    ap.add_argument("--pool", metavar="WORK_POOL",
                    help="register the deployment on this work pool and exit (a worker runs it) instead of serving it")
    ap.add_argument(ALLOW_FLAG, dest="allow_unauthenticated", action="store_true",
                    help="talk to a server beyond loopback without PREFECT_API_AUTH_STRING or PREFECT_API_KEY")
    args = ap.parse_args(argv)
    if not os.environ.get("PREFECT_API_URL"):
        raise SystemExit("deploy: error: PREFECT_API_URL is not set; start `prefect server start` and export "
                         "PREFECT_API_URL=http://127.0.0.1:4200/api (schedules need a real server)")
    refusal = check_api_auth(args.allow_unauthenticated)
    if refusal:
        raise SystemExit(f"deploy: error: {refusal}")
    cfg = load_schedule(args.config)
    if args.pool:
        deployment_id = deploy_to_pool(cfg, args.pool)
        print(f"deployment grpo-pipeline/{cfg.get('name', 'grpo-scheduled')} ({deployment_id}) on work pool "
              f"{args.pool}, source {ROOT}; run it with `prefect worker start --pool {args.pool}`")
        return 0
    from prefect import serve

    serve(build_deployment(cfg))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
