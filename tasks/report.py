"""Stage ``report``: ``reports/report.md`` + ``report.html`` + PNG plots from the stage outputs, and
``<train.metrics_dir>/headline.json``, the one declared metrics file (what ``dvc exp show`` lists)."""

from __future__ import annotations

import logging
from pathlib import Path

from grpo.config.params import SECTIONS
from grpo.config.reading import Params
from grpo.core.jsonio import write_json
from grpo.evaluation.report import build_report, headline_of
from tasks._common import run_stage

log = logging.getLogger(__name__)


def report(params: Params) -> None:
    path = build_report(".", "reports")
    metrics_dir = Path(params.train.metrics_dir)
    write_json(metrics_dir / "headline.json", headline_of(metrics_dir))
    log.info("wrote %s, report.html and %s", path, metrics_dir / "headline.json")


def main(argv: list[str] | None = None) -> int:
    return run_stage("report", report, tuple(SECTIONS.values()), argv)


if __name__ == "__main__":
    raise SystemExit(main())
