"""The check_params stage (``python -m tasks.check_params``): every key of ``params.yaml`` validated
before any other stage runs, so a bad value costs no stage its outputs.

DVC runs a changed stage by removing its outputs first and running its command after
(``dvc/stage/__init__.py:595-596``, ``Stage.run`` -> ``remove_outs``), and only the stage that reads
a key validates it: ``dvc exp run -S train.steps=forty`` used to delete the train stage's outputs
before the train stage refused the value. This stage reads all of ``params.yaml`` and every other
stage depends on its output (``dvc.yaml``); DVC reproduces stages in dependency order and stops at
the first failure (``dvc/repo/reproduce.py:176-191``, ``on_error="fail"``), so a refusal here ends
``dvc repro`` and ``dvc exp run`` before any other stage is looked at: one line on stderr naming the
key (``grpo.config.params.load_params``), exit code 2.

Its output, ``STAMP``, is the same bytes whenever the params are valid, so a change that passes
re-runs nothing downstream for this stage's sake (DVC compares a dependency's hash, not its
mtime), and ``dvc.yaml`` declares it ``persist`` (DVC leaves a persist output in place before the
command, ``dvc/stage/__init__.py:379-381``): a refused run leaves every output as it was. Inside a
workspace ``dvc exp run -S``, which writes its values into ``params.yaml`` before any stage runs, a
refusal also puts ``params.yaml`` back (``tasks._exp_params``), so ``dvc status`` is what it was.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from grpo.config.params import load_params
from grpo.core.errors import ParamsError
from grpo.core.jsonio import DataError, write_json
from grpo.data.split_check import check_params as check_splits

STAMP = Path("metrics/params_check.json")
"""This stage's one output (``dvc.yaml``): ``{"valid": true}``, written after every successful check."""


def check(path: Path) -> None:
    """Validate the params file ``path`` whole (every section, the rules across sections, and the splits
    at the data source's real sizes: ``grpo.data.split_check``, as ``grpo check`` does); a refusal is
    a ``ParamsError`` of one line naming the key, with what became of ``params.yaml`` when a
    ``dvc exp run -S`` had written it (``tasks._exp_params.after_refusal``)."""
    try:
        params = load_params(path)
        check_splits(params, path.resolve().parent)
    except (ParamsError, DataError) as err:
        from tasks._exp_params import after_refusal  # the failure path's: not what the stage writes

        raise ParamsError(f"{err}{after_refusal(path)}") from None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tasks.check_params")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    args = parser.parse_args(argv)
    try:
        check(Path(args.params))
    except (ParamsError, DataError) as err:
        print(f"check_params: error: {err}", file=sys.stderr)
        return 2
    write_json(STAMP, {"valid": True})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
