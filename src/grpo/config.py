"""Typed, validated parameters: the base every ``params.yaml`` section is built on.

Each section is a pydantic model in a module of its own (``grpo.sections.<section>``);
``grpo.params`` gathers them all. This module holds what they share, and nothing of any one
section, so a stage depends (in DVC's sense: ``dvc.yaml``'s deps follow imports) on the schemas of
the sections it reads and on this file.

Contract:

* Every params file is read by ``read_params_yaml`` (``UniqueKeyLoader``): bad YAML, a key that a
  mapping repeats (PyYAML would keep the last silently) or a document that is not a mapping is a
  ``ParamsError`` of one line naming the file and line (``params.yaml:7: duplicate key 'steps'
  (first at line 3); ...``).
* A stage loads the sections it reads (``load_sections(path, *classes)``, a ``Params`` holding
  them); ``grpo.params.load_params`` loads every section. An unknown key, a value of the wrong type
  or out of range fails with a ``ParamsError`` whose message is one line naming the field
  (``train.lr: must be > 0, got -1.0``; an unknown key names the nearest known ones:
  ``train.learning_rate: unknown key; did you mean train.lr?``; a key that moved names its new place,
  ``Section.MOVED``). Building a section directly (``TrainConfig(lr=-1)``) fails the same way.
* A section's defaults are the embedded default run and equal ``params.yaml`` key for key (a test
  enforces it), so a key left out of ``params.yaml`` or of a preset never changes the experiment
  silently. Change a default in its section's module and in ``params.yaml`` together.
* Types and ranges are declared on the fields (``Literal`` choices, ``Field(gt=0)`` bounds, strict
  types: ``"ten"`` is not an integer, ``true`` is not a number); the few rules that tie two fields
  together live in one ``_check`` method per section. A choice names a registry entry (``Choice``);
  an entry's own options are its ``Options`` model, under its name (``EntryOptions``).
* ``reading_params()`` records which ``section.key`` fields are read while it is active (the
  stages run under it when asked, so a test can check each stage's ``params:`` in ``dvc.yaml``).
* ``overlay_params(base, overrides)`` is the one way params are put over ``params.yaml`` (a preset's
  sections, or dotted keys as the flow's ``--set`` gives them; ``grpo check --params`` and the
  tests use it in memory); ``grpo.params.write_params(path, overrides)`` writes its result into the
  file, comments kept, once it validates (``scripts/apply_preset.py``, the flow's ``--set``).
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import difflib
import re
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal

import yaml
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError


class ParamsError(ValueError):
    """Invalid parameters; the message names the offending field."""


class ModelConfigError(ValueError):
    """A model-related parameter names something that does not exist (a module, a directory)."""


class DeviceError(RuntimeError):
    """The device to compute on cannot be used (``grpo.device.default_device``); the message is one
    line saying what to do."""


class StageStop(RuntimeError):
    """A stage stops on purpose (training that keeps producing non-finite values); the message is
    one line saying where and what is left."""


Positive = Annotated[int, Field(gt=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegative = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(gt=0, le=1)]


def Choice(param: str):  # noqa: N802 (a type)
    """A text field whose values are the names of the registry serving ``param``
    (``grpo.choices.registry``): the allowed values have that one home, and an entry registered
    anywhere is a valid value. Checked when the section is built; an unknown name is one line
    naming ``param`` and the names it takes."""

    def check(value: str) -> str:
        from grpo.choices import registry

        return registry(param).check(value, param)

    return Annotated[str, AfterValidator(check)]


def EntryOptions(param: str):  # noqa: N802 (a type)
    """A mapping of entry name -> that entry's options, for the entries of the registry serving
    ``param`` that declare an ``Options`` model (``grpo.registry.Registry.options``); each value is
    validated by its entry's model, and an entry left out takes its model's defaults, so the
    defaults have one home, the entry. A name without options is one line naming the names that
    have them."""

    def check(value: dict) -> dict:
        from grpo.choices import registry

        reg, key = registry(param), f"{param}_options"
        out = {}
        for name, values in value.items():
            model = reg.options(name)
            if model is None:
                raise ValueError(f"{key}.{name}: no {reg.what} of that name has options; those that do: "
                                 f"{', '.join(reg.with_options())}")
            if not isinstance(values, (dict, model)):
                raise ValueError(f"{key}.{name}: must be a mapping, got {values!r}")
            out[name] = values if isinstance(values, model) else model(**values)
        return {**entry_defaults(param)(), **out}  # the entries left out at their defaults, in registration order

    return Annotated[dict[str, Any], AfterValidator(check)]


def entry_defaults(param: str):
    """The default of an ``EntryOptions(param)`` field: each entry's options at their defaults."""

    def make() -> dict:
        from grpo.choices import registry

        reg = registry(param)
        return {name: reg.options(name)() for name in reg.with_options()}

    return make


Dtype = Literal["auto", "bfloat16", "float16", "float32"]

_READS: contextvars.ContextVar[set[str] | None] = contextvars.ContextVar("grpo_param_reads", default=None)


@contextlib.contextmanager
def reading_params():
    """Collect the ``section.key`` names of every params field read inside the block."""
    reads: set[str] = set()
    token = _READS.set(reads)
    try:
        yield reads
    finally:
        _READS.reset(token)


class Section(BaseModel):
    """Base of the params sections: unknown keys and loose types are errors; reads are recordable."""

    model_config = ConfigDict(extra="forbid", strict=True)
    SECTION: ClassVar[str] = ""
    MOVED: ClassVar[dict[str, str]] = {}
    """Keys this section had once -> where they live now (the message for an old params file)."""

    def __init__(self, **values: Any):
        try:
            super().__init__(**values)
        except ValidationError as err:
            raise ParamsError(_one_line(err, type(self))) from None

    def __getattribute__(self, name: str):
        reads = _READS.get()
        if reads is not None and not name.startswith("_") and name in type(self).model_fields:
            reads.add(f"{type(self).SECTION}.{name}")
        return super().__getattribute__(name)


SECTION_NAMES = ("data", "model", "lora", "sent", "evaluate", "train")
"""The sections of a params file, in ``params.yaml``'s order (``grpo.params.AllParams`` has one field each)."""


class Params(BaseModel):
    """Validated sections by name (``params.train``): those a stage loaded (``load_sections``), or
    all of them (``grpo.params.AllParams``, whose defaults are the embedded run). Reading a section
    that was not loaded is an ``AttributeError``."""

    model_config = ConfigDict(extra="allow")


def _describe(err: dict) -> str:
    """One error of a pydantic ``ValidationError`` in this project's words."""
    kind, ctx, value = err["type"], err.get("ctx") or {}, err.get("input")
    if kind == "value_error":
        return str(ctx.get("error", err["msg"]))
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "literal_error":
        return f"must be one of {ctx['expected'].replace(' or ', ', ').replace(chr(39), '')}; got {value!r}"
    bounds = {"greater_than": ">", "greater_than_equal": ">=", "less_than": "<", "less_than_equal": "<="}
    if kind in bounds:
        limit = next(iter(ctx.values()))
        limit = int(limit) if isinstance(limit, float) and limit.is_integer() else limit
        return f"must be {bounds[kind]} {limit}, got {value!r}"
    words = {"int_type": "an integer", "float_type": "a number", "bool_type": "true or false",
             "string_type": "a string", "list_type": "a list", "dict_type": "a mapping", "model_type": "a mapping",
             "too_short": "non-empty"}
    if kind in words:
        return f"must be {words[kind]}, got {value!r}{_number_as_text_hint(kind, value)}"
    return f"{err['msg'][0].lower()}{err['msg'][1:]}, got {value!r}"


_DECIMAL = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?")


def _number_as_text_hint(kind: str, value: Any) -> str:
    """For a number that reached a numeric field as text, how to write it; else nothing (a word
    like ``"fast"`` gets no hint: the message says what type the field takes)."""
    if not isinstance(value, str) or kind not in ("float_type", "int_type"):
        return ""
    text = value.strip()
    if kind == "int_type":
        return f" (quoted: write {text} without quotes)" if re.fullmatch(r"[+-]?\d+", text) else ""
    if not _DECIMAL.fullmatch(text):
        return ""
    mantissa, e, exponent = text.lower().partition("e")
    if e and "." not in mantissa:  # 5e-4: YAML 1.1 (PyYAML, the stages) needs a dot in the mantissa
        return f" (YAML reads {text} as text: write {mantissa}.0e{exponent})"
    return f" (quoted: write {text} without quotes)"


ALIASES: dict[str, str] = {
    # TRL's GRPOConfig / transformers' TrainingArguments names -> this project's train keys
    "learning_rate": "lr", "num_generations": "group_size", "max_completion_length": "max_new_tokens",
    "max_steps": "steps", "num_iterations": "mu", "gradient_accumulation_steps": "micro_batches",
    "lr_scheduler_type": "lr_schedule", "scale_rewards": "advantage_scale", "reward_weights": "rewards",
    "top_entropy_quantile": "entropy_top_quantile", "save_steps": "checkpoint_every", "eval_steps": "eval_every",
    "use_vllm": "rollout_backend", "vllm_gpu_memory_utilization": "gpu_memory_utilization",
    "vllm_importance_sampling_correction": "importance_sampling_correction",
    "vllm_importance_sampling_cap": "importance_sampling_cap", "kl_coef": "beta", "cliprange": "epsilon",
    "per_device_train_batch_size": "prompts_per_step", "epsilon_low": "epsilon",
    # peft's LoraConfig names -> the lora keys
    "r": "rank", "lora_r": "rank", "lora_alpha": "alpha", "lora_dropout": "dropout",
    # the model
    "torch_dtype": "dtype", "model_name": "name", "model_name_or_path": "name", "load_in_4bit": "quantization",
}
"""Keys people bring from other tools -> the nearest key here (suggested where the section has it)."""


def suggest(name: str, known: list[str] | set[str] | tuple[str, ...], n: int = 3) -> list[str]:
    """The known names nearest to ``name``: its alias (``ALIASES``), then the closest spellings."""
    out = [ALIASES[name]] if ALIASES.get(name) in known else []
    out += [k for k in difflib.get_close_matches(name, sorted(known), n=n, cutoff=0.6) if k not in out]
    return out[:n]


def _did_you_mean(prefix: str, names: list[str]) -> str:
    names = [f"{prefix}{n}" for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def _one_line(err: ValidationError, cls: type[Section]) -> str:
    """The first error of ``err`` (building ``cls``) as ``section.key: what is wrong`` (one line)."""
    first = err.errors(include_url=False)[0]
    if first["type"] == "value_error":  # a cross-field rule: its message already names the field
        return _describe(first)
    section = cls.SECTION
    loc = ".".join(str(p) for p in (section, *first["loc"]) if p != "")
    message = f"{loc}: {_describe(first)}"
    if first["type"] == "extra_forbidden":
        key = str(first["loc"][-1]) if first["loc"] else ""
        if key in cls.MOVED:
            return f"{loc}: moved to {cls.MOVED[key]}"
        near = suggest(key, set(cls.model_fields))
        message += (f"; did you mean {_did_you_mean(f'{section}.', near)}?" if near else
                    f"; {section} has no key like it ({len(cls.model_fields)} keys: docs/configuration.md)")
    return message.replace("\n", " ")


def section_mappings(raw: dict | None) -> dict[str, dict]:
    """The sections of a params mapping, each a mapping (``{}`` for one left empty); ``ParamsError``
    of one line for a document that is not a mapping, a section name outside ``SECTION_NAMES``
    (with the nearest names) or a section that is not a mapping."""
    raw = raw or {}
    if not isinstance(raw, dict):
        raise ParamsError(f"params: must be a mapping of sections, got {raw!r}")
    for key in raw:
        if key not in SECTION_NAMES:
            near = suggest(str(key), set(SECTION_NAMES))
            guess = f"did you mean {_did_you_mean('', near)}? " if near else ""
            raise ParamsError(f"{key}: unknown params section; {guess}(sections: {', '.join(sorted(SECTION_NAMES))})")
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
        node = out
        for i, part in enumerate(parts):
            if node.get(part) is None:
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                where = ".".join(parts[:i + 1])
                raise ParamsError(f"{where}: must be a mapping, got {node!r}" + (f" (to set {key})" if where != key else ""))
        for name, new in items:
            node[name] = new
    return out


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


def yaml_error_line(path: Path, err: yaml.YAMLError) -> str:
    """One line for a YAML file PyYAML refuses: ``FILE:LINE: what``, where it can tell the line."""
    if isinstance(err, DuplicateKey):
        return (f"{path}:{err.again}: duplicate key {err.key!r} (first at line {err.first}); a mapping takes each "
                "key once")
    mark = getattr(err, "problem_mark", None)
    what = " ".join(": ".join(x for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x).split())
    if mark is None:
        return f"{path}: not valid YAML ({' '.join(str(err).split())})"
    return f"{path}:{mark.line + 1}: not valid YAML ({what or 'unreadable'}, column {mark.column + 1})"


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
        raise ParamsError(yaml_error_line(path, err)) from None
    if raw is not None and not isinstance(raw, dict):
        raise ParamsError(f"{path}: must be a mapping of sections, got {raw!r}")
    return raw or {}
