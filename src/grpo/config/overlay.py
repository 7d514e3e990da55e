"""``overlay_params(base, overrides)``: the one way params are put over ``params.yaml`` (a preset's
sections, or dotted keys as ``dvc exp run -S`` and the flow's ``--set`` write them); ``grpo check
--params`` and the tests use it in memory, ``grpo.config.params.write_params`` writes its result into the
file once it validates. Only those users import it: a stage that loads params does not depend on it."""

from __future__ import annotations

import copy

from grpo.core.errors import ParamsError


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

    An override is a section with any subset of its keys, at any depth (a preset:
    ``{"train": {"optimizer": {"lr": 5e-4}}}``: the mappings it names are merged key by key, so the
    keys of ``train.optimizer`` it leaves out keep their values) or a dotted key of any depth
    (``{"train.optimizer.lr": 5e-4}``, as ``dvc exp run -S`` and the flow's ``--set`` write them).
    The one mapping taken whole is a reward table (``WHOLE``: a preset's ``rewards`` are the run's
    rewards, not a merge), as is any value a dotted key names. A section left empty in ``base`` (``train:``) counts as one with no
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
            _put(node, name, new, merge=len(str(key).split(".")) == 1)
    return out


WHOLE = ("rewards",)
"""Mappings a preset replaces whole: names chosen by the user (reward functions), not keys of a schema."""


def _put(node: dict, name: str, new: object, merge: bool) -> None:
    """``node[name] = new``, or with ``merge`` and both mappings (not ``WHOLE``), ``new``'s keys put
    into the existing mapping one by one, recursively."""
    old = node.get(name)
    if merge and isinstance(new, dict) and isinstance(old, dict) and name not in WHOLE:
        for key, value in new.items():
            _put(old, key, value, merge=True)
    else:
        node[name] = new
