"""Every section of a params file together: ``AllParams``, and the readers and writer of whole files.

A stage loads only the sections it reads (``grpo.config.reading.load_sections``); the tools that see a run
whole (``grpo check``, the report, the flow's ``--set``, presets, ablations) validate every section
here, with the rules that tie two sections together (``grpo.config.sections.train.check_across_sections``). ``AllParams()`` is
the embedded default run, equal to ``params.yaml`` key for key (tests/test_params.py).
"""

from __future__ import annotations

import io
from pathlib import Path

import yaml
from pydantic import ConfigDict, Field

from grpo.config.overlay import overlay_params
from grpo.config.reading import Params, read_params_yaml, section_mappings
from grpo.config.sections.data_section import DataConfig
from grpo.config.sections.decode import DecodeConfig
from grpo.config.sections.evaluate_section import EvaluateConfig
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.sent import SentConfig
from grpo.config.sections.train import TrainConfig, check_across_sections
from grpo.core.errors import ParamsError


class AllParams(Params):
    """Every section, each defaulting to the embedded run's."""

    model_config = ConfigDict(extra="forbid")
    data: DataConfig = Field(default_factory=DataConfig)
    model: ModelConfig = Field(default_factory=ModelConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    sent: SentConfig = Field(default_factory=SentConfig)
    evaluate: EvaluateConfig = Field(default_factory=EvaluateConfig)
    decode: DecodeConfig = Field(default_factory=DecodeConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)


SECTIONS = {name: field.default_factory for name, field in AllParams.model_fields.items()}
"""Section name -> its class, in ``params.yaml``'s order."""


def params_from_dict(raw: dict | None) -> AllParams:
    """Validated ``AllParams`` from a plain mapping (sections or keys left out take the defaults)."""
    sections = {name: SECTIONS[name](**values) for name, values in section_mappings(raw).items()}
    return check_across_sections(AllParams(**sections))


def _float_yaml11(representer, value: float):
    """A float that YAML 1.1 readers (PyYAML: the stages, ``load_params``) also read as a number:
    ``5.0e-06``, not ruamel's ``5e-06``, which they read as text."""
    text = repr(value)
    if "e" in text and "." not in text.split("e")[0]:
        mantissa, exponent = text.split("e")
        text = f"{mantissa}.0e{exponent}"
    return representer.represent_scalar("tag:yaml.org,2002:float", text)



def write_params(path: str | Path, overrides: dict | None) -> Params:
    """Put ``overrides`` over the params file ``path`` (``overlay_params``) and write it back, its
    comments and key order kept, so it stays complete as ``dvc.yaml``'s ``params:`` need; the result,
    read back as the stages read it, is validated first and returned. A missing or unreadable file or
    a bad result writes nothing and raises ``ParamsError``: one line naming the file or the field."""
    from ruamel.yaml import YAML
    from ruamel.yaml.error import YAMLError

    path = Path(path)
    read_params_yaml(path)  # its one-line errors (ruamel's would span lines); ruamel also refuses repeated keys
    rt = YAML()
    rt.representer.add_representer(float, _float_yaml11)
    try:
        doc = rt.load(path.read_text())
    except YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML ({' '.join(str(err).split())})") from None
    if doc is not None and not isinstance(doc, dict):
        raise ParamsError(f"{path}: must be a mapping of sections, got {doc!r}")
    out = io.StringIO()
    rt.dump(overlay_params(doc, overrides), out)
    params = params_from_dict(yaml.safe_load(out.getvalue()))
    path.write_text(out.getvalue())
    return params



def load_params(path: str | Path = "params.yaml") -> Params:
    """Read (``read_params_yaml``) and validate ``params.yaml``."""
    return params_from_dict(read_params_yaml(path))
