"""Shared entry-point plumbing for the stage modules: argument parsing, clean failures, wall time.

``run_stage`` loads ``--params``, runs the stage body and writes ``<train.metrics_dir>/time/<stage>.json``
(``{"seconds": ...}``), a metric of that stage in ``dvc.yaml``, so each run's times live with its
outputs (an experiment keeps its own). With ``GRPO_PARAMS_READ_LOG=FILE`` in the environment it
also appends ``{"stage", "params"}`` to FILE: the params fields the stage read (tests check them
against the stage's ``params:`` in ``dvc.yaml``). A data-parallel stage passes ``writes`` from
``grpo.distributed.writes_outputs()``, so only its rank 0 (and the launching process) write them
(``grpo.distributed`` is not imported here: it would become a DVC dep of every stage).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from grpo.config import DeviceError, ModelConfigError, Params, ParamsError, StageStop, load_params, reading_params
from grpo.jsonio import DataError, write_json

USER_ERRORS = (ParamsError, DataError, ModelConfigError, DeviceError, StageStop, FileNotFoundError)


def run_stage(name: str, body: Callable[[Params], None], argv: list[str] | None = None, *,
              writes: bool = True) -> int:
    """Parse ``--params``, load and validate them, run ``body``; a user error becomes one line
    on stderr and exit code 2. ``writes``: whether this process writes the stage's time (and the
    params-read log); False in the ranks other than 0 of a data-parallel stage."""
    parser = argparse.ArgumentParser(prog=f"python -m tasks.{name}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(levelname)s %(message)s")
    t0 = time.perf_counter()
    try:
        params = load_params(args.params)
        with reading_params() as reads:
            body(params)
            metrics_dir = Path(params.train.metrics_dir)
    except USER_ERRORS as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    if not writes:  # another process of a data-parallel stage: rank 0 writes
        return 0
    write_json(metrics_dir / "time" / f"{name}.json", {"seconds": round(time.perf_counter() - t0, 2)})
    if os.environ.get("GRPO_PARAMS_READ_LOG"):
        with open(os.environ["GRPO_PARAMS_READ_LOG"], "a") as fh:
            fh.write(json.dumps({"stage": name, "params": sorted(reads)}) + "\n")
    return 0
