"""The schema of a check's JSON report, and the check of a report against it (``device_check.py``
and its phase scripts declare their parts of the schema; ``schema_errors`` checks a file).

A schema names every key of the file, once. A leaf is ``"TYPE: what it holds"``; TYPE is ``str``,
``int``, ``number``, ``bool``, ``list[str]`` or ``object`` (any JSON object), with ``?`` where null
is allowed. A dict is an object with exactly these keys; a list holding one dict is a list of such
objects.
"""

from __future__ import annotations

import math

_TYPES = {"str": (str,), "int": (int,), "number": (int, float), "bool": (bool,), "object": (dict,)}


def _leaf_errors(value, spec: str, where: str) -> list[str]:
    """A leaf's value against ``TYPE: ...`` (module docstring)."""
    kind = spec.split(":", 1)[0].strip()
    nullable = kind.endswith("?")
    kind = kind.rstrip("?")
    if value is None:
        return [] if nullable else [f"{where}: null, expected {kind}"]
    if kind == "list[str]":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return [f"{where}: expected a list of strings, got {value!r}"]
        return []
    types = _TYPES[kind]
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        return [f"{where}: expected {kind}, got {type(value).__name__} {value!r}"]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{where}: {value} is not a finite number"]
    return []


def schema_errors(value, schema, where: str = "") -> list[str]:
    """Every way ``value`` (a loaded report) departs from ``schema``: a key missing or not in the
    schema, a value of the wrong type, a null where none is allowed; ``[]`` when it conforms."""
    if isinstance(schema, str):
        return _leaf_errors(value, schema, where or "(top)")
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [e for i, item in enumerate(value) for e in schema_errors(item, schema[0], f"{where}[{i}]")]
    if not isinstance(value, dict):
        return [f"{where or '(top)'}: expected an object, got {type(value).__name__}"]
    prefix = f"{where}." if where else ""
    errors = [f"{prefix}{k}: missing" for k in schema if k not in value]
    errors += [f"{prefix}{k}: not in the schema" for k in value if k not in schema]
    for key in schema:
        if key in value:
            errors += schema_errors(value[key], schema[key], prefix + key)
    return errors


def blank(schema):
    """An object of ``schema``'s keys with every leaf null, every list empty (filled in as the check goes)."""
    if isinstance(schema, dict):
        return {k: blank(v) for k, v in schema.items()}
    return [] if isinstance(schema, list) or schema.startswith("list[str]:") else None
