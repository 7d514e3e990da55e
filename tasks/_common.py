"""Shared entry-point plumbing for the stage modules: argument parsing and clean failures."""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time
from collections.abc import Callable
from pathlib import Path

from grpo.config import Params, ParamsError, load_params
from grpo.data import DataError, write_json
from grpo.models import ModelConfigError

USER_ERRORS = (ParamsError, DataError, ModelConfigError, FileNotFoundError)


def run_stage(name: str, body: Callable[[Params], None], argv: list[str] | None = None) -> int:
    """Parse ``--params``, load and validate them, run ``body``; a user error becomes one line
    on stderr and exit code 2."""
    parser = argparse.ArgumentParser(prog=f"python -m tasks.{name}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(levelname)s %(message)s")
    t0 = time.perf_counter()
    try:
        params = load_params(args.params)
        body(params)
    except USER_ERRORS as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    record_time(name, time.perf_counter() - t0)
    return 0


def record_time(stage: str, seconds: float, path: Path = Path("outputs/timings.json")) -> None:
    """Remember the last wall time of each stage for the report (outside DVC's outputs on purpose:
    a cached stage keeps the time of the run that produced its outputs)."""
    times = json.loads(path.read_text()) if path.exists() else {}
    times[stage] = round(seconds, 1)
    write_json(path, times)
