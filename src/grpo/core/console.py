"""What a stage prints on the terminal, and where everything else goes.

Contract: ``setup(stage, verbose)`` is called once, first, by a stage's entry point,
``route_libraries`` once its params are valid and ``name_log`` when it succeeds. By default the
terminal shows the project's own records (loggers ``grpo.*`` and ``tasks.*``, INFO and up), other
libraries' errors, and the project's progress bars; every record of every logger (vLLM's and
transformers' INFO lines, bitsandbytes' and Python's warnings) goes to ``outputs/logs/<stage>.log``
(``<stage>.rank<k>.log`` in the other processes of a data-parallel stage), which the stage's
last line names. Terminal lines are written through ``tqdm.write`` so that they never break a bar. With
``verbose`` (``--verbose``, or ``GRPO_VERBOSE=1`` in the environment, for ``dvc repro``) every
record reaches the terminal as before.

Libraries are routed before they are imported: vLLM's own handler off (``VLLM_CONFIGURE_LOGGING=0``:
its records then reach the root logger), wandb's terminal lines off (``WANDB_SILENT``),
transformers' handler replaced by propagation and its loading bars off (the hub's download bars
stay), vLLM's weight-loading bar off (``grpo.rollout.engine.args``). Lines a library writes to the terminal itself
(C extensions, ``print``) are not records and stay.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

VERBOSE_ENV = "GRPO_VERBOSE"
LOG_DIR = Path("outputs/logs")
OWN_LOGGERS = ("grpo", "tasks", "__main__")  # __main__: a stage run as `python -m tasks.<stage>`
QUIET_ENV = {"VLLM_CONFIGURE_LOGGING": "0", "WANDB_SILENT": "true"}
"""Set (unless the user set them) before the libraries are imported, so that they log through ``logging``."""


def verbose_from_env(environ=os.environ) -> bool:
    """Whether ``GRPO_VERBOSE`` asks for every library's lines on the terminal (any value but "", "0")."""
    return environ.get(VERBOSE_ENV, "") not in ("", "0")


def is_own(record: logging.LogRecord) -> bool:
    """A record of the project's own loggers."""
    return any(record.name == n or record.name.startswith(n + ".") for n in OWN_LOGGERS)


class TerminalFilter(logging.Filter):
    """The project's records at INFO and up; other libraries' at ERROR and up."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno >= (logging.INFO if is_own(record) else logging.ERROR)


class TqdmHandler(logging.StreamHandler):
    """A stderr handler that writes through ``tqdm.write``: a line printed under a running bar
    moves the bar below it instead of breaking it."""

    def emit(self, record: logging.LogRecord) -> None:
        from tqdm import tqdm

        try:
            tqdm.write(self.format(record), file=self.stream)
        except Exception:  # noqa: BLE001 (logging's contract: a failed emit is reported, not raised)
            self.handleError(record)


class LazyFileHandler(logging.FileHandler):
    """A file handler that makes its file (and folder) at its first record, not before: a stage
    that stops on a bad input before logging anything leaves no log behind."""

    def __init__(self, path: Path):
        super().__init__(path, mode="w", encoding="utf-8", delay=True)

    def _open(self):
        Path(self.baseFilename).parent.mkdir(parents=True, exist_ok=True)
        return super()._open()


def log_file(stage: str, environ=os.environ) -> Path:
    """The stage's log file: ``outputs/logs/<stage>.log``, ``<stage>.rank<k>.log`` on rank k > 0."""
    rank = environ.get("RANK", "0")
    return LOG_DIR / (f"{stage}.log" if rank in ("", "0") else f"{stage}.rank{rank}.log")


def _route_transformers() -> None:
    """transformers' records to the root logger instead of its own stderr handler."""
    try:
        from transformers.utils import logging as hf_logging
    except ImportError:
        return
    hf_logging.disable_default_handler()
    hf_logging.enable_propagation()
    hf_logging.disable_progress_bar()  # loading and conversion bars; it turns the hub's off too:
    from huggingface_hub.utils import enable_progress_bars

    enable_progress_bars()  # a download's bar stays (minutes for a hub model)


def setup(stage: str, verbose: bool = False) -> Path | None:
    """Configure logging for ``stage`` (the contract in the module's docstring); return the log
    file, or None when verbose."""
    fmt = logging.Formatter(f"[{stage}] %(levelname)s %(message)s")
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.INFO)
    terminal = TqdmHandler(sys.stderr)
    terminal.setFormatter(fmt)
    root.addHandler(terminal)
    if verbose:
        return None
    for key, value in QUIET_ENV.items():
        os.environ.setdefault(key, value)
    path = log_file(stage)
    every = LazyFileHandler(path)
    every.setFormatter(logging.Formatter("%(asctime)s %(name)s %(levelname)s %(message)s"))
    root.addHandler(every)
    terminal.addFilter(TerminalFilter())
    logging.captureWarnings(True)  # warnings.warn -> the "py.warnings" logger: the file, not the terminal
    return path


def route_libraries(path: Path | None) -> None:
    """Once the stage's params are valid (a typo costs no library import): transformers' records
    to the log file too."""
    if path is not None:
        _route_transformers()


def name_log(path: Path | None) -> None:
    """The stage's last line when it succeeds: where the other libraries' messages are (a failing
    stage keeps its one error line)."""
    if path is not None:
        logging.getLogger("grpo.core.console").info("other libraries' messages: %s (GRPO_VERBOSE=1 shows them here)", path)
