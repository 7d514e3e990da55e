"""Stage ``train``: GRPO on the (curriculum-ordered) training set; writes the adapter and metrics.

The run is ``grpo.training.run.run`` (its docstring: the outputs, resume, the data-parallel launch);
this module maps its failures to one line on stderr and an exit code: Ctrl-C 130 (the line says what
was kept), a failed process of a multi-process launch its exit code (``grpo.training.launcher.LaunchFailed``),
a collective timeout in a worker ``grpo.core.distributed.TIMEOUT_EXIT_CODE``. With
``train.distribution.num_processes`` N > 1 the launched workers are ``python -m tasks.train`` with the same
arguments.
"""

from __future__ import annotations

import functools
import sys

from grpo.config.reading import Params
from grpo.config.sections.decode import DecodeConfig
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.distributed import TIMEOUT_EXIT_CODE, CollectiveTimeout, writes_outputs
from grpo.data.split_check import check_training_files
from grpo.training.launcher import LaunchFailed
from grpo.training.run import Interrupted, run
from tasks._common import run_stage


def train(params: Params, argv: list[str] = ()) -> None:
    check_training_files(params.train)  # an empty validation split or too small a stage stops here, before the model loads
    run(params, worker=["-m", "tasks.train", *argv])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    try:
        return run_stage("train", functools.partial(train, argv=argv), (TrainConfig, LoraConfig, ModelConfig, DecodeConfig), argv,
                         writes=writes_outputs())
    except Interrupted as err:
        print(f"train: {err}", file=sys.stderr)
        return 130  # the shell's code for a command ended by SIGINT
    except LaunchFailed as err:
        print(f"train: error: {err}", file=sys.stderr)
        return err.code
    except CollectiveTimeout as err:  # in a worker (the launcher names the rank that hangs)
        print(f"train: error: {err}", file=sys.stderr)
        return TIMEOUT_EXIT_CODE


if __name__ == "__main__":
    raise SystemExit(main())
