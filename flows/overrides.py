"""The flow's params overrides (``--set KEY=VALUE``, a deployment's ``overrides``): their values, and
the check of the params a run would use, before anything is written or Prefect is imported.

No Prefect import here: ``python -m flows.pipeline`` checks the params (``check_run_params``) before
it starts the flow (and with it, without ``PREFECT_API_URL``, Prefect's temporary server), so a bad
key or value is one ``flow: error:`` line in seconds, no server started; the flow writes them with
``apply_overrides`` (``flows/dvc_flow.py``), which validates the same way before writing.
"""

from __future__ import annotations

from pathlib import Path

from grpo.core.errors import ParamsError


def override_values(overrides: dict[str, str]) -> dict[str, object]:
    """``{"train.optimizer.lr": "5e-4"}`` -> ``{"train.optimizer.lr": 0.0005}``: each text value read as
    YAML (as ``params.yaml`` would hold it); a value that is not text is kept."""
    from ruamel.yaml import YAML

    return {key: YAML(typ="safe").load(raw) if isinstance(raw, str) else raw for key, raw in overrides.items()}


def refusal(params_path: Path, overrides: dict[str, str] | None, err: ParamsError) -> ParamsError:
    """The one-line error of params the stages would refuse, naming the overrides (or the file)."""
    if overrides:
        return ParamsError(f"overrides {', '.join(overrides)} over {params_path}: {err}")
    return err if str(err).startswith(str(params_path)) else ParamsError(f"{params_path}: {err}")


def check_params(params_path: Path, overrides: dict[str, str] | None = None) -> None:
    """Validate ``params_path`` with ``overrides`` put over it, in memory (``grpo.config.params``: every
    section and the rules across them, what the check_params stage runs); ``ParamsError`` of one line
    naming the key and the overrides (``refusal``). Nothing is written. A workspace without a params
    file and no overrides has nothing to check."""
    from grpo.config.overlay import overlay_params
    from grpo.config.params import params_from_dict
    from grpo.config.reading import read_params_yaml

    if not overrides and not params_path.exists():
        return
    try:
        params_from_dict(overlay_params(read_params_yaml(params_path), override_values(overrides or {})))
    except ParamsError as err:
        raise refusal(params_path, overrides, err) from None


def check_run_params(root: Path, overrides: dict[str, str] | None = None) -> None:
    """``check_params`` of the workspace ``root``'s ``params.yaml`` with ``overrides``, when the run sets
    any or when ``root``'s ``dvc.yaml`` has a guard stage (``grpo.core.dvcfile.Stage.guard``: this project's
    ``check_params``, whose check this is, in memory and before any server); a workspace of other
    stages is left to them."""
    from grpo.core.dvcfile import DVC_YAML, PARAMS_YAML, read_stages

    if overrides or any(stage.guard for stage in read_stages(root / DVC_YAML).values()):
        check_params(root / PARAMS_YAML, overrides)
