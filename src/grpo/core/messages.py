"""The one-line messages of invalid params, in this project's words: a pydantic error as
``section.key: what is wrong``, the did-you-mean of an unknown key or section (with the names
people bring from other tools, ``ALIASES``), a moved key's new place, and a YAML file's error with
its line.

Only failure paths import this module (``grpo.config.reading`` where it raises ``ParamsError``), so no
stage's DVC deps name it: a change of wording re-runs nothing (tests/test_dvc_graph.py leaves out
imports made only on the way to a ``raise``)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

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


def did_you_mean(prefix: str, names: list[str]) -> str:
    """``names`` (each after ``prefix``) as one alternative: ``a``, or ``a, b or c``."""
    names = [f"{prefix}{n}" for n in names]
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def unknown_section(key: str, sections: tuple[str, ...]) -> str:
    """The line for a top-level key of a params file that is no section of ``sections``."""
    near = suggest(str(key), set(sections))
    guess = f"did you mean {did_you_mean('', near)}? " if near else ""
    return f"{key}: unknown params section; {guess}(sections: {', '.join(sorted(sections))})"


def describe(err: dict) -> str:
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


def one_line(err: ValidationError, cls) -> str:
    """The first error of ``err`` (building the section class ``cls``: its ``SECTION``, ``MOVED``
    and fields) as ``section.key: what is wrong`` (one line). An unknown key in a part of the
    section (``train.loss.epsilon``) is answered from that part's fields and the section's ``MOVED``."""
    first = err.errors(include_url=False)[0]
    if first["type"] == "value_error":  # a cross-field rule: its message already names the field
        return describe(first)
    section = cls.SECTION
    loc = ".".join(str(p) for p in (section, *first["loc"]) if p != "")
    message = f"{loc}: {describe(first)}"
    if first["type"] == "extra_forbidden":
        key = str(first["loc"][-1]) if first["loc"] else ""
        if key in cls.MOVED:  # an older params file: every moved key of it, each in its own clause
            return "; ".join(_moved(err, cls))
        part, prefix = _part_at(cls, first["loc"][:-1])
        alias = ALIASES.get(key)
        if alias in cls.MOVED and alias not in part.model_fields:
            return f"{message}; did you mean {cls.MOVED[alias].split(' ')[0]}?"
        near = suggest(key, set(part.model_fields))
        message += (f"; did you mean {did_you_mean(f'{prefix}.', near)}?" if near else
                    f"; {prefix} has no key like it ({len(part.model_fields)} keys: docs/configuration.md)")
    return message.replace("\n", " ")


def _moved(err: ValidationError, cls) -> list[str]:
    """``section.key: moved to NEW`` for each unknown key of ``err`` that ``cls.MOVED`` names."""
    out = []
    for e in err.errors(include_url=False):
        key = str(e["loc"][-1]) if e["type"] == "extra_forbidden" and e["loc"] else ""
        if key in cls.MOVED:
            loc = ".".join(str(p) for p in (cls.SECTION, *e["loc"]) if p != "")
            out.append(f"{loc}: moved to {cls.MOVED[key]}")
    return out


def _part_at(cls, loc: tuple) -> tuple[type, str]:
    """The model class of the part of ``cls`` that ``loc`` (field names) leads to, with its dotted
    name (``train.loss``); where ``loc`` leaves the nested models, the last one reached."""
    prefix = cls.SECTION
    for name in loc:
        field = cls.model_fields.get(str(name))
        sub = getattr(field, "annotation", None)
        if not (isinstance(sub, type) and issubclass(sub, BaseModel)):
            break
        cls, prefix = sub, f"{prefix}.{name}"
    return cls, prefix


def yaml_error_line(path: Path, err: yaml.YAMLError) -> str:
    """One line for a YAML file PyYAML refuses: ``FILE:LINE: what``, where it can tell the line (a
    repeated key, ``grpo.config.reading.DuplicateKey``, names both lines)."""
    if hasattr(err, "first") and hasattr(err, "again"):  # grpo.config.reading.DuplicateKey
        return (f"{path}:{err.again}: duplicate key {err.key!r} (first at line {err.first}); a mapping takes each "
                "key once")
    mark = getattr(err, "problem_mark", None)
    what = " ".join(": ".join(x for x in (getattr(err, "context", None), getattr(err, "problem", None)) if x).split())
    if mark is None:
        return f"{path}: not valid YAML ({' '.join(str(err).split())})"
    return f"{path}:{mark.line + 1}: not valid YAML ({what or 'unreadable'}, column {mark.column + 1})"
