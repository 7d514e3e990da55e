"""Typed, validated parameters: reading a params file and loading its sections.

Each section is a pydantic model in a module of its own (``grpo.config.sections.<section>``), built on
the field types and ``Section`` of ``grpo.core.fields``, its choices on the registries of
``grpo.config.choices``; ``grpo.config.params`` gathers them all. This module holds the reading of a params file
and the loading of sections, nothing of any one section and no registry, so a stage depends (in
DVC's sense: ``dvc.yaml``'s deps follow imports) on the schemas of the sections it reads, on this
file and on ``grpo.core.errors``. What changes more often lives apart: the wording of every message
(``grpo.core.messages``, imported only on the way to a ``ParamsError``, so no stage depends on it) and
the overlay of params (``grpo.config.overlay.overlay_params``, imported by its users alone).

Contract:

* Every params file is read by ``read_params_yaml`` (``UniqueKeyLoader``): bad YAML, a key that a
  mapping repeats (PyYAML would keep the last silently) or a document that is not a mapping is a
  ``ParamsError`` (``grpo.core.errors``) of one line naming the file and line (``params.yaml:7: duplicate
  key 'steps' (first at line 3); ...``).
* A stage loads the sections it reads (``load_sections(path, *classes)``, a ``Params`` holding
  them); ``grpo.config.params.load_params`` loads every section. An unknown key, a value of the wrong type
  or out of range fails with a ``ParamsError`` whose message is one line naming the field
  (``train.optimizer.lr: must be > 0, got -1.0``; an unknown key names the nearest known ones:
  ``train.learning_rate: unknown key; did you mean train.optimizer.lr?``; a key that moved names its new place,
  ``Section.MOVED``). Building a section directly (``TrainConfig(lr=-1)``) fails the same way.
* A section's defaults are the embedded default run and equal ``params.yaml`` key for key (a test
  enforces it), so a key left out of ``params.yaml`` or of a preset never changes the experiment
  silently. Change a default in its section's module and in ``params.yaml`` together.
* Types and ranges are declared on the fields (``Literal`` choices, ``Field(gt=0)`` bounds, strict
  types: ``"ten"`` is not an integer, ``true`` is not a number; ``grpo.core.fields``); the few rules that
  tie two fields together live in one ``_check`` method per section. A choice names a registry entry
  (``grpo.config.choices.Choice``); an entry's own options are its ``Options`` model, under its name
  (``grpo.config.choices.EntryOptions``).
* ``grpo.core.fields.reading_params()`` records which ``section.key`` fields are read while it is active
  (the stages run under it when asked, so a test can check each stage's ``params:`` in ``dvc.yaml``).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import yaml
from pydantic import BaseModel, ConfigDict

from grpo.core.errors import ParamsError

if TYPE_CHECKING:
    from grpo.core.fields import Section

SECTION_NAMES = ("data", "model", "lora", "sent", "evaluate", "decode", "train")
"""The sections of a params file, in ``params.yaml``'s order (``grpo.config.params.AllParams`` has one field each)."""


class Params(BaseModel):
    """Validated sections by name (``params.train``): those a stage loaded (``load_sections``), or
    all of them (``grpo.config.params.AllParams``, whose defaults are the embedded run). Reading a section
    that was not loaded is an ``AttributeError``."""

    model_config = ConfigDict(extra="allow")


def section_mappings(raw: dict | None) -> dict[str, dict]:
    """The sections of a params mapping, each a mapping (``{}`` for one left empty); ``ParamsError``
    of one line for a document that is not a mapping, a section name outside ``SECTION_NAMES``
    (with the nearest names) or a section that is not a mapping."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ParamsError(f"params: must be a mapping of sections, got {raw!r}")
    for key in raw:
        if key not in SECTION_NAMES:
            # lazy: a failure path's wording; grpo.core.messages stays out of every stage's deps
            from grpo.core.messages import unknown_section

            raise ParamsError(unknown_section(key, SECTION_NAMES))
    out = {}
    for name, values in raw.items():
        if values is not None and not isinstance(values, dict):
            raise ParamsError(f"{name}: must be a mapping, got {values!r}")
        out[name] = values or {}
    return out


def load_sections(path: str | Path, *classes: type[Section]) -> Params:
    """The sections ``classes`` of the params file ``path``, validated (keys left out take their
    defaults), as a ``Params``; the file's other sections are only checked to be sections. A stage
    loads what it reads, so it imports (and DVC makes it depend on) those sections' schemas alone."""
    raw = section_mappings(read_params_yaml(path))
    return Params(**{cls.SECTION: cls(**raw.get(cls.SECTION, {})) for cls in classes})


class DuplicateKey(yaml.MarkedYAMLError):
    """A YAML mapping names one key twice (``key``; ``first``, ``again``: 1-based line numbers)."""

    def __init__(self, key, first: int, again: yaml.Mark):
        super().__init__(problem=f"duplicate key {key!r}", problem_mark=again)
        self.key, self.first, self.again = key, first, again.line + 1


class UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's safe loader, except that a mapping that repeats a key raises ``DuplicateKey``
    (PyYAML keeps the last value silently). Merge keys (``<<``) are not repeats."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                if key in seen:
                    raise DuplicateKey(key, seen[key], key_node.start_mark)
                seen[key] = key_node.start_mark.line + 1
        return super().construct_mapping(node, deep=deep)


def read_params_yaml(path: str | Path) -> dict:
    """The mapping in the params file ``path`` (``{}`` when empty), read by ``UniqueKeyLoader``: every
    reader of params goes through here. A missing file, a YAML error, a repeated key or a
    document that is not a mapping raises ``ParamsError``, one line naming the file (and the line)."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found")
    try:
        raw = yaml.load(path.read_text(), Loader=UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        # lazy: a failure path's wording; grpo.core.messages stays out of every stage's deps
        from grpo.core.messages import yaml_error_line

        raise ParamsError(yaml_error_line(path, err)) from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of sections, got {raw!r}")
    return raw or {}
