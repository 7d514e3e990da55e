"""What becomes of ``params.yaml`` when ``tasks.check_params`` refuses it inside ``dvc exp run``.

``dvc exp run -S key=value`` writes its values into ``params.yaml`` before any stage runs
(``dvc/repo/experiments/queue/base.py:320-323`` -> ``apply_overrides`` of ``dvc/utils/hydra.py``, lines
83-120, whose YAML writer also re-flows the file: ``["+"]`` becomes a block list), and a failed experiment in the
workspace leaves the file so (``WorkspaceExecutor.cleanup``, ``dvc/repo/experiments/executor/local.py:247``,
resets refs, not files): the bad value would stay in ``params.yaml`` and ``dvc status`` would
report a change the user never made. ``after_refusal`` puts the file back, under a rule that loses
no change of the user's but a value of the key ``-S`` itself replaced:

* only inside a workspace experiment: DVC sets ``DVC_EXP_BASELINE_REV`` and ``DVC_ROOT`` in every
  stage's environment, and the stage runs in ``DVC_ROOT`` (a ``--temp`` or queued run works in a
  copy, which DVC discards);
* only when this run has ``-S`` values for ``params.yaml``, read from the ``dvc exp run`` process
  that started the stage (its command line, parsed by DVC's own parser);
* only when DVC's own writer, given the baseline commit's ``params.yaml`` and those values, writes
  exactly the bytes now in the file: the workspace then held the commit's file before the run (up to
  the values ``-S`` replaced), and writing the commit's file back undoes the experiment alone.

This module imports DVC: only the failure path of the check imports it (no stage depends on it).
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from pathlib import Path


def exp_set_params(argv: list[str]) -> list[str] | None:
    """The ``-S``/``--set-param`` values of ``argv`` when it is a ``dvc exp run`` command line
    (``dvc ...``, ``python .../bin/dvc ...``, ``python -m dvc ...``), else None."""
    from dvc.cli.parser import get_main_parser

    start = next((i + 1 for i, arg in enumerate(argv) if Path(arg).name == "dvc"), None)
    if start is None or argv[start:start + 2] != ["exp", "run"]:
        return None
    try:
        args = get_main_parser().parse_args(argv[start:])
    except SystemExit:  # not a command line DVC itself would take
        return None
    return list(args.set_param or [])


def _running_exp_set_params() -> list[str] | None:
    """The ``-S`` values of the ``dvc exp run`` process this one runs under, or None."""
    import psutil

    for proc in psutil.Process().parents():
        try:
            values = exp_set_params(proc.cmdline())
        except psutil.Error:
            continue
        if values is not None:
            return values
    return None


def dvc_rewrite(text: str, overrides: list[str]) -> str:
    """``text`` (a ``params.yaml``) as ``dvc exp run -S`` writes it with ``overrides`` (DVC's writer)."""
    from dvc.utils.hydra import apply_overrides

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp, "params.yaml")
        path.write_text(text)
        apply_overrides(path, overrides)
        return path.read_text()


def _committed(root: Path, rev: str, path: Path) -> str | None:
    proc = subprocess.run(["git", "show", f"{rev}:./{path.resolve().relative_to(root.resolve())}"], cwd=root,
                          capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else None


def after_refusal(path: Path) -> str:
    """Put ``path`` back as the experiment's baseline commit has it when the rule above allows; the
    words to add to the refusal's line (``""`` outside a workspace ``dvc exp run -S``)."""
    rev, root = os.environ.get("DVC_EXP_BASELINE_REV"), os.environ.get("DVC_ROOT")
    if not rev or not root or Path.cwd().resolve() != Path(root).resolve():
        return ""
    values = _running_exp_set_params()
    if not values:
        return ""
    from dvc.utils.cli_parse import to_path_overrides

    ours = [o for file, overrides in to_path_overrides(values).items() if Path(root, file).resolve() == path.resolve()
            for o in overrides]
    committed = _committed(Path(root), rev, path) if ours else None
    if committed is None:
        return ""
    try:
        same = dvc_rewrite(committed, ours) == path.read_text()
    except Exception:  # noqa: BLE001 (DVC's writer refused what it wrote before: not ours to put back)
        same = False
    if not same:
        return f"; {path} keeps what `dvc exp run -S` wrote (it held uncommitted changes before the run)"
    path.write_text(committed)
    return f"; {path} is back as commit {rev[:7]} has it, as before `dvc exp run`"
