"""A DVC workspace's ``dvc.yaml`` read once, and the folder it lives in (no DVC, no Prefect import).

``read_stages(path)`` is the one reader of ``dvc.yaml``: the library (``grpo check``, the report),
the Prefect flow and the tests take the stages, their order and what each reads and writes from it.
It reads the file as written, without DVC's templating: a ``foreach``/``matrix`` stage is returned
with ``templated`` set and its top-level keys only.

``find_root(path)`` is the one walk up the folders: the nearest directory at or above ``path`` that
holds ``dvc.yaml`` (a workspace: its stages, ``params.yaml`` and the paths they name), or, with
``marker=DVC_DIR``, a ``.dvc`` folder (DVC's own repository root, which a ``dvc`` command started in
any folder below it locks).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

DVC_YAML = "dvc.yaml"
DVC_DIR = ".dvc"
PARAMS_YAML = "params.yaml"


@dataclass(frozen=True)
class Stage:
    """One stage of ``dvc.yaml``; paths and keys as written there (relative to the workspace)."""

    cmd: str | list[str] | None = None
    deps: tuple[str, ...] = ()
    outs: tuple[str, ...] = ()  # ``outs``, ``metrics`` and ``plots``: all are the stage's outputs to DVC
    uncached: tuple[str, ...] = ()  # those of ``outs`` declared ``cache: false`` (git keeps them)
    params: tuple[str, ...] = ()  # keys or whole sections of params.yaml: ``model.path``, ``train``
    all_params: bool = False  # ``- params.yaml:`` with no keys: the stage reads every key
    templated: bool = False  # a ``foreach`` or ``matrix`` stage (its paths are not expanded here)
    guard: bool = False  # ``meta: {guard: true}``: its outputs are the same bytes whenever it succeeds, so its
    # re-running re-runs nothing downstream (tasks/check_params.py); DVC ignores ``meta``


def _paths(spec: dict, key: str) -> tuple[list[str], list[str]]:
    """The paths listed under ``key`` (``- path`` or ``- path: {options}``), and those with ``cache: false``."""
    paths, uncached = [], []
    for item in spec.get(key) or []:
        if isinstance(item, dict):
            paths += [str(p) for p in item]
            uncached += [str(p) for p, opts in item.items() if (opts or {}).get("cache") is False]
        else:
            paths.append(str(item))
    return paths, uncached


def _stage(spec) -> Stage:
    if not isinstance(spec, dict):
        return Stage()
    deps, _ = _paths(spec, "deps")
    outs, uncached = [], []
    for key in ("outs", "metrics", "plots"):
        paths, off = _paths(spec, key)
        outs += paths
        uncached += off
    params, all_params = [], False
    for item in spec.get("params") or []:
        if isinstance(item, dict):  # {file.yaml: [keys]}: only params.yaml is ours; no keys means all of it
            for file, keys in item.items():
                if file == PARAMS_YAML:
                    params += [str(k) for k in keys or []]
                    all_params = all_params or not keys
        else:
            params.append(str(item))
    return Stage(cmd=spec.get("cmd"), deps=tuple(deps), outs=tuple(outs), uncached=tuple(uncached),
                 params=tuple(params), all_params=all_params, templated=bool({"foreach", "matrix"} & set(spec)),
                 guard=isinstance(spec.get("meta"), dict) and bool(spec["meta"].get("guard")))


def read_stages(path: Path) -> dict[str, Stage]:
    """``{name: Stage}`` of the ``dvc.yaml`` file at ``path``, in the file's order (``{}`` when it has no
    stages). A missing file raises ``FileNotFoundError``."""
    spec = yaml.safe_load(Path(path).read_text()) or {}
    return {str(name): _stage(stage) for name, stage in (spec.get("stages") or {}).items()}


def find_root(path: Path, marker: str = DVC_YAML) -> Path | None:
    """The nearest directory at or above ``path`` (``path`` itself included) holding ``marker``: the file
    ``dvc.yaml`` (the default) or the folder ``.dvc`` (``DVC_DIR``); None when no directory does."""
    holds = Path.is_dir if marker == DVC_DIR else Path.is_file
    for d in (path, *path.parents):
        if holds(d / marker):
            return d
    return None
