"""The data-parallel launch of training on one machine: N processes through torch.distributed's
launcher (``elastic_launch``, what ``torchrun --standalone`` runs), each of which joins the process
group through ``grpo.core.distributed``; the launching process waits for them and ends with their status.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import uuid
from collections.abc import Sequence

from grpo.core.distributed import LAUNCHER_PID, TIMEOUT_EXIT_CODE

log = logging.getLogger(__name__)


class LaunchFailed(Exception):
    """A training process of a multi-process launch failed (the message names its rank); ``code``:
    its exit code (1 when a signal ended it)."""

    def __init__(self, message: str, code: int):
        super().__init__(message)
        self.code = code


def launch_processes(n: int, args: Sequence[str], timeout_s: float) -> None:
    """Run ``python *args`` (the train stage's: ``-m tasks.train --params FILE``) as ``n``
    data-parallel processes on this machine through torch.distributed's launcher (``torchrun
    --standalone --nproc-per-node n``: a c10d rendezvous on a free local port, no restarts) and wait
    for them. A process that fails makes the launcher stop the others (SIGTERM; SIGKILL after
    torch's 30 s grace: a frozen process ignores SIGTERM); ``LaunchFailed`` then names its rank and
    exit code, or, when it timed out in a collective (``timeout_s``, the workers'
    ``train.distribution.dist_timeout_s``), the ranks that were still running: the ones that hang. Each process
    gets ``cores / n`` threads unless ``OMP_NUM_THREADS`` is set."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, len(os.sched_getaffinity(0)) // n)))
    os.environ[LAUNCHER_PID] = str(os.getpid())  # the workers die with this process (die_with_parent)
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=n, run_id=uuid.uuid4().hex, rdzv_backend="c10d",
                          rdzv_endpoint="localhost:0", max_restarts=0, monitor_interval=0.1)
    log.info("launching %d training processes (torch.distributed, c10d rendezvous on localhost)", n)
    try:
        elastic_launch(config, sys.executable)(*args)
    except ChildFailedError as err:
        rank, failure = err.get_first_failure()
        code = failure.exitcode if failure.exitcode > 0 else 1
        if failure.exitcode == TIMEOUT_EXIT_CODE:
            stopped = (-signal.SIGTERM, -signal.SIGKILL)  # the launcher's: these were still running
            hung = sorted(r for r, f in err.failures.items() if r != rank and f.exitcode in stopped)
            if hung:
                names = ", ".join(map(str, hung))
                raise LaunchFailed(f"training process rank {names} hung: rank {rank} timed out waiting for it in a "
                                   f"collective (train.distribution.dist_timeout_s = {timeout_s:g} s); the launcher stopped "
                                   f"every process", code) from None
            raise LaunchFailed(f"training process rank {rank} timed out in a collective (train.distribution.dist_timeout_s = "
                               f"{timeout_s:g} s) and no process was left running; see their output above",
                               code) from None
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        raise LaunchFailed(f"training process rank {rank} failed ({how}); the launcher stopped the other "
                           f"{n - 1} process(es); see rank {rank}'s output above", code) from None
