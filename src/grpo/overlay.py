"""``overlay_params(base, overrides)``: the one way params are put over ``params.yaml`` (a preset's
sections, or dotted keys as ``dvc exp run -S`` and the flow's ``--set`` write them); ``grpo check
--params`` and the tests use it in memory, ``grpo.params.write_params`` writes its result into the
file once it validates. Only those users import it: a stage that loads params does not depend on it."""

from __future__ import annotations

import copy

from grpo.errors import ParamsError


def _node(out: dict, parts: list[str], key: str) -> dict:
    """The mapping at ``parts`` in ``out``, made where missing; ``ParamsError`` naming ``key`` when
    the way passes through a value that is not a mapping."""
    node = out
    for i, part in enumerate(parts):
        if node.get(part) is None:
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            where = ".".join(parts[:i + 1])
            raise ParamsError(f"{where}: must be a mapping, got {node!r}" + (f" (to set {key})" if where != key else ""))
    return node


def overlay_params(base: dict, overrides: dict | None) -> dict:
    """A copy of ``base`` (a params mapping: sections of keys) with ``overrides`` put over it; ``base``
    is left as it was (a ruamel document's comments and order are copied along).

    An override is a section with any subset of its keys (a preset: ``{"train": {"lr": 5e-4}}``) or a
    dotted key of any depth (``{"train.lr": 5e-4}``, as ``dvc exp run -S`` and the flow's ``--set``
    write them). Either way each key named gets the new value whole (a preset's ``rewards`` is the
    run's rewards, not a merge). A section left empty in ``base`` (``train:``) counts as one with no
    keys; a section or key missing from ``base`` is added, and an unknown one is left for validation
    to name. The one error here: the way to a key passes through a value that is not a mapping
    (``ParamsError`` naming the key)."""
    out = copy.deepcopy(base) if base is not None else {}
    for section in list(out):
        if out[section] is None:
            out[section] = {}
    for key, value in (overrides or {}).items():
        parts = str(key).split(".")
        if len(parts) == 1:  # a section and some of its keys
            if not isinstance(value, dict):
                raise ParamsError(f"{key}: must be a mapping, got {value!r}")
            parts, items = [key], value.items()
        else:
            parts, items = parts[:-1], [(parts[-1], value)]
        node = _node(out, parts, key)
        for name, new in items:
            node[name] = new
    return out
