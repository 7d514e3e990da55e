"""Shared body of the ``baseline_eval`` and ``final_eval`` stages."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from grpo.config.reading import Params
from grpo.core.jsonio import write_json, write_jsonl
from grpo.evaluation.evaluate import evaluate

log = logging.getLogger(__name__)


def run_eval(params: Params, name: str, adapter_dir: str | None) -> dict:
    """Evaluate, write ``metrics/<name>.json`` and ``outputs/eval/<name>.jsonl`` (per problem). The
    work folder ``outputs/eval/<name>_work`` (the exported weights) is gone when this returns or
    raises."""
    work = Path("outputs/eval") / f"{name}_work"
    try:
        metrics, per_problem = evaluate(params, adapter_dir, work)
    finally:  # the exported weights are a temporary copy, removed whether the evaluation ends or fails
        shutil.rmtree(work, ignore_errors=True)
    selection = Path(adapter_dir or "", "selection.json")
    if adapter_dir and selection.exists():  # which of the run's adapters the train stage wrote
        metrics["adapter"] = json.loads(selection.read_text())
    write_jsonl(Path("outputs/eval") / f"{name}.jsonl", per_problem)
    write_json(Path(params.train.metrics_dir) / f"{name}.json", metrics)
    log.info("%s: accuracy %.3f [%.3f, %.3f] (95%%, clustered as the report's: effective n %.0f of %d), format %.3f (%s, %s)",
             name, metrics["accuracy"], metrics["ci_low"], metrics["ci_high"], metrics["effective_n"], metrics["n"],
             metrics["format_rate"], metrics["backend"], metrics["weights"])
    return metrics
