"""Whether training would use its splits wrongly, and the splits ``grpo check`` reports.

``train_refusals(cfg, train_rows, val_rows)`` gives one line per way training would use those rows
wrongly: a validation interval (``train.checkpoints.eval_every``) with no validation row to
evaluate, or a curriculum stage holding fewer rows than one step's prompts (a step would take one
problem twice). A run whose ``steps x prompts_per_step`` exceeds the training rows is not refused:
each stage's steps wrap around its rows by design (``grpo.algorithm.curriculum.batch_indices``); an interval
longer than ``train.steps`` still fires once, after the last step (``Trainer.eval_due``).
``check_params`` runs the data part (``grpo.data.split_sizes``) and this one at the source's sizes
(``grpo check``); the train stage runs this one on the rows it read.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from grpo.algorithm.curriculum import num_stages_of, stage_of_step, stages_for
from grpo.core.jsonio import text_lines
from grpo.data.split_sizes import NAMES, SPLITS, asked, data_refusals, expected_rows, refuse, supply


def train_refusals(cfg, train_rows: int | None, val_rows: int | None, val_what: str) -> list[str]:
    """One line per way the train section ``cfg`` would misuse ``train_rows`` training rows and
    ``val_rows`` validation rows (None: not known); ``val_what`` says where the validation rows come from."""
    out = []
    every = cfg.checkpoints.eval_every
    if every and val_rows == 0:
        out.append(f"train.checkpoints.eval_every: {every} evaluates {cfg.checkpoints.val_path} every {every} steps, "
                   f"but it holds no row ({val_what}): carve a validation split (data.val_size) or set eval_every 0")
    k = cfg.rollouts.prompts_per_step
    if train_rows:
        smallest = min(len(s) for s in stages_for(cfg.order, train_rows, num_stages_of(cfg), cfg.seed))
        if smallest < k:
            out.append(f"train.rollouts.prompts_per_step: {k} prompts a step, but train.order {cfg.order}'s smallest "
                       f"stage holds {smallest} of the {train_rows} training rows: a step would take one problem twice")
    return out


def check_training_files(cfg) -> None:
    """``train_refusals`` on the rows the train section ``cfg``'s files hold now (the train stage's
    start; a missing file is left to the reader that needs it)."""
    train_rows = _file_rows({}, Path(cfg.data_path))
    val_rows = _file_rows({}, Path(cfg.checkpoints.val_path)) if cfg.checkpoints.eval_every else None
    refuse(train_refusals(cfg, train_rows, val_rows, "the file"))


def passes_line(cfg, train_rows: int) -> str:
    """What training takes of ``train_rows`` rows: ``steps x prompts_per_step`` prompts, and the
    busiest stage's prompts beside its rows (more prompts than rows: its steps wrap around them)."""
    stages = stages_for(cfg.order, train_rows, num_stages_of(cfg), cfg.seed)
    steps = Counter(stage_of_step(i, cfg.steps, len(stages)) for i in range(cfg.steps))
    k = cfg.rollouts.prompts_per_step
    busiest = max(range(len(stages)), key=lambda s: steps[s] * k / len(stages[s]))
    return (f"training: {cfg.steps} steps x {k} prompts = {cfg.steps * k} prompts from {train_rows} rows in "
            f"{len(stages)} stage(s); the busiest stage {steps[busiest] * k} prompts from its {len(stages[busiest])} rows")


def _resolved(root: Path, path: str) -> Path:
    return (root / path).resolve()


def check_params(params, root: str | Path = ".") -> list[str]:
    """The splits ``params`` would get, one line each, for ``grpo check``; a ``DataError`` (one
    line, naming each key) where a split would be empty or short or training would misuse one."""
    root = Path(root)
    d, t = params.data, params.train
    found = supply(d, root)
    refusals = data_refusals(d, found)
    rows = expected_rows(d, found)
    out_dir = _resolved(root, d.out_dir)
    produced = {out_dir / "train.jsonl": rows["train"], out_dir / "val.jsonl": rows["val"]}
    if _resolved(root, params.sent.data_path) == out_dir / "train.jsonl":
        produced[_resolved(root, params.sent.out_path)] = rows["train"]  # SENT reorders the train split
    train_rows = _file_rows(produced, _resolved(root, t.data_path))
    val_rows = _file_rows(produced, _resolved(root, t.checkpoints.val_path))
    val_what = (f"prepare_data writes {rows['val']} from data.val_size {d.val_size}"
                if _resolved(root, t.checkpoints.val_path) in produced else "the file")
    refusals += train_refusals(t, train_rows, val_rows, val_what)
    refuse(refusals)
    lines = [f"{NAMES[s]} {rows[s]} of {asked(d)[s]} asked ({found.where[s]})" for s in SPLITS]
    if train_rows:
        lines.append(passes_line(t, train_rows))
    return lines


def _file_rows(produced: dict[Path, int | None], path: Path) -> int | None:
    """Rows of ``path``: the pipeline's count where a stage writes it, else the file's lines, else None."""
    if path in produced:
        return produced[path]
    if path.is_file():
        return sum(1 for _ in text_lines(path))
    return None
