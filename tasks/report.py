"""Stage ``report``: ``reports/report.md`` + ``report.html`` + PNG plots from the stage outputs."""

from __future__ import annotations

import logging

from grpo.config import Params
from grpo.report import build_report
from tasks._common import run_stage

log = logging.getLogger(__name__)


def report(params: Params) -> None:
    path = build_report(".", "reports")
    log.info("wrote %s and report.html", path)


def main(argv: list[str] | None = None) -> int:
    return run_stage("report", report, argv)


if __name__ == "__main__":
    raise SystemExit(main())
