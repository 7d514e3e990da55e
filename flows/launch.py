"""``python -m flows.pipeline``'s command line: it refuses a busy workspace before Prefect is imported.

No Prefect import at module level: ``flows/pipeline.py`` hands its ``__main__`` to ``main()`` here before
its own imports, and ``main()`` imports the flow (and so Prefect) only once the workspace lock is held. A
refused run (a busy workspace, an unknown stage) therefore answers at once, having written nothing.

``STAGE_TIMEOUT_S`` is the default of the flow's ``stage_timeout_s`` parameter: the longest one stage's
``dvc repro`` may run (``--stage-timeout`` here, ``stage_timeout_s`` in a deployment's parameters).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from flows.process import StageFailed, StageTimeout
from flows.server_auth import ALLOW_FLAG, check_api_auth
from flows.workspace import WorkspaceBusy, dvc_stages, workspace_lock
from grpo.config import DeviceError, ParamsError

# One stage's limit: long enough for a full training run, short enough that a hung stage frees the
# workspace (and its scheduled runs) within the night of a daily schedule.
STAGE_TIMEOUT_S = 6 * 3600.0

# Without PREFECT_API_URL the flow starts Prefect's temporary ("ephemeral") server, which Prefect
# waits 20 s for by default (prefect/settings/models/server/ephemeral.py); a busy 2-core machine can
# take longer, so the flow waits this long unless the user set the variable.
EPHEMERAL_TIMEOUT = "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"
EPHEMERAL_TIMEOUT_S = 120


def stages_of(workdir: str | Path) -> list[str]:
    """The workspace's stages in ``dvc.yaml``'s order."""
    return dvc_stages(Path(workdir).resolve())


def select_stages(known: list[str], wanted: list[str] | None) -> list[str]:
    """``wanted`` in ``known``'s order (all of ``known`` when None); ``ValueError`` naming unknown ones."""
    unknown = [s for s in (wanted or []) if s not in known]
    if unknown:
        raise ValueError(f"stages: unknown {', '.join(unknown)}; dvc.yaml has: {', '.join(known)}")
    return [s for s in known if not wanted or s in wanted]


def _positive(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text}")
    return value


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m flows.pipeline", description="Run the DVC pipeline as a Prefect flow.")
    ap.add_argument("--workdir", default=".")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                    help="override a param (repeatable), e.g. --set train.lr=5e-4; the run becomes a DVC experiment")
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
            os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
            os.environ.setdefault(EPHEMERAL_TIMEOUT, str(EPHEMERAL_TIMEOUT_S))
            from flows.pipeline import pipeline

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
