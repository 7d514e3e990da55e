"""Shared entry-point plumbing for the stage modules: argument parsing, clean failures, wall time.

``run_stage`` loads the sections of ``--params`` the stage reads (``grpo.config.reading.load_sections``: the
stage depends on those sections' schemas alone), runs the stage body and writes ``<train.metrics_dir>/time/<stage>.json``
(``{"seconds": ...}``), a metric of that stage in ``dvc.yaml``, so each run's times live with its
outputs (an experiment keeps its own). A run of another params file (``--params FILE``, not the
workspace's ``params.yaml``) writes it only when ``FILE``'s ``train.metrics_dir`` is not the
workspace's: the workspace's file is an output DVC tracks, and a new time in it would make
``dvc repro`` run the stage again (``time_file``). With ``GRPO_PARAMS_READ_LOG=FILE`` in the environment it
also appends ``{"stage", "params"}`` to FILE: the params fields the stage read (tests check them
against the stage's ``params:`` in ``dvc.yaml``). A data-parallel stage passes ``writes`` from
``grpo.core.distributed.writes_outputs()``, so only its rank 0 (and the launching process) write them
(``grpo.core.distributed`` is not imported here: it would become a DVC dep of every stage).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

from grpo.config.reading import Params, load_sections, read_params_yaml
from grpo.config.sections.shared import SharedTrainKeys
from grpo.core import console
from grpo.core.errors import DeviceError, ModelConfigError, ParamsError, StageStop
from grpo.core.fields import Section, reading_params
from grpo.core.jsonio import DataError, write_json

USER_ERRORS = (ParamsError, DataError, ModelConfigError, DeviceError, StageStop, FileNotFoundError)
WORKSPACE_PARAMS = Path("params.yaml")
"""The workspace's params file: the one in the current directory, where DVC runs each stage."""


def _workspace_metrics_dir() -> str:
    """``train.metrics_dir`` of the workspace's params file (its default when the file does not say)."""
    try:
        train = read_params_yaml(WORKSPACE_PARAMS).get("train")
    except (ParamsError, OSError):
        train = None
    train = train if isinstance(train, dict) else {}
    return str(train.get("metrics_dir", SharedTrainKeys.model_fields["metrics_dir"].default))


def time_file(name: str, params_path: str | Path, metrics_dir: str | Path) -> Path | None:
    """Where the stage ``name`` run with ``params_path`` writes its wall time:
    ``<metrics_dir>/time/<name>.json``; None when the params are another file than
    ``WORKSPACE_PARAMS`` and that path is the workspace's own time file (under the workspace's
    ``train.metrics_dir``), which only a run of the workspace's params may change. Without a
    workspace params file, always the path."""
    path = Path(metrics_dir, "time", f"{name}.json")
    if not WORKSPACE_PARAMS.is_file() or Path(params_path).resolve() == WORKSPACE_PARAMS.resolve():
        return path
    own = Path(_workspace_metrics_dir(), "time", f"{name}.json")
    return None if own.resolve() == path.resolve() else path


def run_stage(name: str, body: Callable[[Params], None], sections: tuple[type[Section], ...],
              argv: list[str] | None = None, *, writes: bool = True) -> int:
    """Parse ``--params``, load and validate the ``sections`` the stage reads (one of them the
    ``train`` section, whole or as ``OtherStagesTrainKeys``), run ``body``; a user error becomes one line
    on stderr and exit code 2. ``writes``: whether this process writes the stage's time (where
    ``time_file`` says) and the params-read log; False in the ranks other than 0 of a data-parallel
    stage."""
    parser = argparse.ArgumentParser(prog=f"python -m tasks.{name}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--verbose", action="store_true",
                        help=f"every library's messages on the terminal too (or {console.VERBOSE_ENV}=1; "
                             "by default they go to the log file the first line names)")
    args = parser.parse_args(argv)
    log_path = console.setup(name, verbose=args.verbose or console.verbose_from_env())
    t0 = time.perf_counter()
    try:
        params = load_sections(args.params, *sections)
        console.route_libraries(log_path)
        with reading_params() as reads:
            body(params)
            metrics_dir = Path(params.train.metrics_dir)
    except USER_ERRORS as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    console.name_log(log_path)
    if not writes:  # another process of a data-parallel stage: rank 0 writes
        return 0
    path = time_file(name, args.params, metrics_dir)
    if path is not None:
        write_json(path, {"seconds": round(time.perf_counter() - t0, 2)})
    if os.environ.get("GRPO_PARAMS_READ_LOG"):
        with open(os.environ["GRPO_PARAMS_READ_LOG"], "a") as fh:
            fh.write(json.dumps({"stage": name, "params": sorted(reads)}) + "\n")
    return 0
