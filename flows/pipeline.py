"""``python -m flows.pipeline``: the pipeline's command line, which refuses a busy workspace or bad
params before Prefect is imported.

    python -m flows.pipeline                                  # like `dvc repro`, with Prefect logs
    python -m flows.pipeline --set train.optimizer.lr=5e-4 --name lr5e-4  # an experiment `dvc exp show` lists
    python -m flows.pipeline --stages prepare_data sent         # only these stages (dvc.yaml's order)

No Prefect import at module level: ``main()`` imports the flow (``flows/dvc_flow.py``, and so
Prefect) only once the workspace lock is held and the params the run would use (``params.yaml`` with
the ``--set`` values put over it, in memory) are valid (``flows.overrides.check_run_params``). A refused run
(a busy workspace, an unknown stage, a remote server without credentials, a bad key or value)
therefore answers at once in one line, having written nothing and started no server. The flow
never imports this module (no import cycle): what both need, the stage list and
``STAGE_TIMEOUT_S`` (the default of ``--stage-timeout``, the flow's ``stage_timeout_s``), is
``flows/workspace.py``'s.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flows.overrides import check_run_params
from flows.process import StageFailed, StageTimeout
from flows.server_auth import ALLOW_FLAG, check_api_auth
from flows.workspace import STAGE_TIMEOUT_S, WorkspaceBusy, select_stages, stages_of, workspace_lock
from grpo.core.errors import DeviceError, ParamsError

# Without PREFECT_API_URL the flow starts Prefect's temporary ("ephemeral") server, which Prefect
# waits 20 s for by default (prefect/settings/models/server/ephemeral.py); a busy 2-core machine can
# take longer, so the flow waits this long unless the user set the variable.
EPHEMERAL_TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
EPHEMERAL_TIMEOUT_S = 120


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flows.pipeline", description="Run the DVC pipeline as a Prefect flow.")
    ap.add_argument("--workdir", default=".", metavar="DIR",
                    help="the DVC workspace to run: its dvc.yaml, params.yaml and outputs (default: the current folder)")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a param (repeatable), e.g. --set train.optimizer.lr=5e-4; the run becomes a DVC experiment")
    ap.add_argument("--name", help="experiment name (with --set)")
    ap.add_argument("--stages", nargs="*", help="run only these stages of dvc.yaml (default: all)")
    ap.add_argument("--stage-timeout", type=_positive, default=STAGE_TIMEOUT_S, metavar="SECONDS",
                    help="stop a stage that runs longer, its processes included, and fail the flow "
                         f"(default {STAGE_TIMEOUT_S:g})")
    ap.add_argument(ALLOW_FLAG, dest="allow_unauthenticated", action="store_true",
                    help="report to a Prefect server beyond loopback without PREFECT_API_AUTH_STRING or PREFECT_API_KEY")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Run the flow on ``--workdir``; exit 2 with one ``flow: error:`` line when refused before any stage
    (busy workspace, unknown stage, bad params), 1 when a stage timed out or Prefect's server did not start."""
    ap = _parser()
    args = ap.parse_args(argv)
    bad = [s for s in args.sets if "=" not in s]
    if bad:
        ap.error(f"--set {bad[0]}: expected KEY=VALUE")
    overrides = dict(s.split("=", 1) for s in args.sets)
    root = Path(args.workdir).resolve()
    try:
        select_stages(stages_of(root), args.stages)
    except ValueError as err:
        print(f"flow: error: {err}", file=sys.stderr)
        return 2
    if os.environ.get("PREFECT_API_URL"):  # a server of the user's (unset: Prefect's temporary local one)
        refusal = check_api_auth(args.allow_unauthenticated)
        if refusal:
            print(f"flow: error: {refusal}", file=sys.stderr)
            return 2
    try:
        with workspace_lock(root):  # before Prefect starts: a busy workspace is refused at once
            check_run_params(root, overrides)  # and bad params: no server started, nothing written
            os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
            os.environ.setdefault(EPHEMERAL_TIMEOUT, str(EPHEMERAL_TIMEOUT_S))
            from flows.dvc_flow import pipeline

            results = pipeline(str(root), overrides or None, args.name, args.stages, args.stage_timeout)
    except (WorkspaceBusy, ParamsError, DeviceError) as err:
        print(f"flow: error: {err}", file=sys.stderr)
        return 2
    except (StageTimeout, StageFailed) as err:  # a failed stage's own output is already on the console
        print(f"flow: error: {err}", file=sys.stderr)
        return 1
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
