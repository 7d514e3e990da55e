"""Stage ``prepare_data``: write ``data/raw/{train,test}.jsonl`` from the configured source."""

from __future__ import annotations

import logging
from pathlib import Path

from grpo.config import Params
from grpo.data import generate_arithmetic, write_jsonl
from tasks._common import run_stage

log = logging.getLogger(__name__)


def prepare_data(params: Params) -> None:
    cfg = params.data
    kw = dict(
        min_terms=cfg.min_terms,
        max_terms=cfg.max_terms,
        min_digits=cfg.min_digits,
        max_digits=cfg.max_digits,
        operators=tuple(cfg.operators),
    )
    train = generate_arithmetic(cfg.train_size, cfg.seed, prefix="train", **kw)
    # reasoning-gym seeds item i with seed + i: offset the test seed past the train range
    test = generate_arithmetic(cfg.test_size, cfg.seed + 1_000_000, prefix="test", **kw)
    seen = {r["question"] for r in train}
    kept = [r for r in test if r["question"] not in seen]
    log.info("train %d, test %d (%d dropped: question also in train)", len(train), len(kept), len(test) - len(kept))
    write_jsonl(Path(cfg.out_dir) / "train.jsonl", train)
    write_jsonl(Path(cfg.out_dir) / "test.jsonl", kept)


def main(argv: list[str] | None = None) -> int:
    return run_stage("prepare_data", prepare_data, argv)


if __name__ == "__main__":
    raise SystemExit(main())
