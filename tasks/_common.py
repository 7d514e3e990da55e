"""Shared entry-point plumbing for the stage modules: argument parsing and clean failures."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

from grpo.config import Params, ParamsError, load_params
from grpo.data import DataError
from grpo.models import ModelConfigError

USER_ERRORS = (ParamsError, DataError, ModelConfigError, FileNotFoundError)


def run_stage(name: str, body: Callable[[Params], None], argv: list[str] | None = None) -> int:
    """Parse ``--params``, load and validate them, run ``body``; a user error becomes one line
    on stderr and exit code 2."""
    parser = argparse.ArgumentParser(prog=f"python -m tasks.{name}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"[{name}] %(levelname)s %(message)s")
    try:
        params = load_params(args.params)
        body(params)
    except USER_ERRORS as err:
        print(f"{name}: error: {err}", file=sys.stderr)
        return 2
    return 0
