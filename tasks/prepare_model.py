"""Stage ``prepare_model``: materialise ``model.name`` as a Hugging Face directory at ``model.path``."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from grpo.config.reading import Params
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.shared import OtherStagesTrainKeys
from grpo.model.base_model import resolve_base_model
from tasks._common import run_stage

log = logging.getLogger(__name__)


def prepare_model(params: Params) -> None:
    out = Path(params.model.path)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    manifest = resolve_base_model(params.model.name, tmp)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    log.info("base model at %s (from %s; its manifest: %s)", out, manifest.get("source", "?"), Path(out) / "manifest.json")


def main(argv: list[str] | None = None) -> int:
    return run_stage("prepare_model", prepare_model, (ModelConfig, OtherStagesTrainKeys), argv)


if __name__ == "__main__":
    raise SystemExit(main())
