"""Stage ``prepare_data``: write ``data/raw/{train,test,val}.jsonl`` (and ``stats.json``) from ``data.source``."""

from __future__ import annotations

import logging
from pathlib import Path

from grpo.config.reading import Params
from grpo.config.sections.data_section import DataConfig
from grpo.config.sections.shared import OtherStagesTrainKeys
from grpo.core.jsonio import write_json, write_jsonl
from grpo.data.sources import prepare_splits
from grpo.data.split_sizes import data_refusals, drawn_supply, refuse, supply
from tasks._common import run_stage

log = logging.getLogger(__name__)


def prepare_data(params: Params) -> None:
    refuse(data_refusals(params.data, supply(params.data)))  # before a download or a draw
    train, test, val, stats = prepare_splits(params.data)
    if stats["held_out_by"] != "question text":  # a generator's draw can stop short of its count
        refuse(data_refusals(params.data, drawn_supply(stats)))
    log.info(
        "%s: train %d, test %d, validation %d (%d test rows dropped: question also in train; %d duplicate train "
        "rows; %d validation rows seen or repeated; %d rejected)",
        stats["source"], stats["train"], stats["test"], stats["val"], stats["test_dropped_shared_with_train"],
        stats["train_duplicates_dropped"], stats["val_dropped_seen_or_repeated"], stats["rejected_rows"],
    )
    out = Path(params.data.out_dir)
    write_jsonl(out / "train.jsonl", train)
    write_jsonl(out / "test.jsonl", test)
    write_jsonl(out / "val.jsonl", val)
    write_json(out / "stats.json", stats, sort_keys=True)


def main(argv: list[str] | None = None) -> int:
    return run_stage("prepare_data", prepare_data, (DataConfig, OtherStagesTrainKeys), argv)


if __name__ == "__main__":
    raise SystemExit(main())
