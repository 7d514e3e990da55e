"""The training run's directory (``train.output_dir``): what a run writes and what survives a crash.

Layout::

    fingerprint            the params and data the run belongs to (grpo.training.checkpoint.reset_if_changed)
    steps.jsonl            one row per step (truncated to the checkpoint on resume)
    samples.jsonl          the sampled completions of every step, with their rewards (same)
    checkpoints/           grpo.training.checkpoint: step_XXXXXX/ (the two newest), damaged/
    best_adapter/          with ``train.checkpoints.keep_best``: the adapter of the best validation accuracy so
                           far, with selection.json ({"adapter", "step", "val_accuracy"})

``RunDir`` is the one place that decides which adapter the stage ships (``ship``): the best
validation one when ``keep_best`` saved one, else the last step's. Only the process that writes
outputs (rank 0) uses it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from grpo.training import checkpoint


class RunDir:
    def __init__(self, root: str | Path, keep_best: bool):
        self.root = Path(root)
        self.keep_best = keep_best
        self.checkpoints = self.root / "checkpoints"
        self.steps = self.root / "steps.jsonl"
        self.samples = self.root / "samples.jsonl"
        self.best = self.root / "best_adapter"

    # ------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, step: int, model, optimizer, scheduler, data_position: int) -> Path:
        """Write ``checkpoints/step_XXXXXX`` atomically; keep the two newest (``grpo.training.checkpoint.save``)."""
        return checkpoint.save(self.checkpoints, step, model, optimizer, scheduler, data_position=data_position)

    def latest_checkpoint(self) -> Path | None:
        """The newest ``checkpoints/step_XXXXXX`` folder (not verified), or None."""
        found = sorted(self.checkpoints.glob("step_*")) if self.checkpoints.is_dir() else []
        return found[-1] if found else None

    def load_latest(self, device: str = "cpu") -> checkpoint.Checkpoint | None:
        """The newest checkpoint that verifies and reads (damaged ones are logged and moved aside)."""
        return checkpoint.load_latest(self.checkpoints, device)

    def resume_logs(self, step: int) -> list[dict]:
        """Make the directory that of a run at ``step``: the step log and samples truncated to it,
        a best adapter saved after it removed; returns the step rows kept."""
        self.root.mkdir(parents=True, exist_ok=True)
        rows = checkpoint.truncate_jsonl(self.steps, step)
        checkpoint.truncate_jsonl(self.samples, step)
        selection = self.best / "selection.json"
        if selection.exists() and json.loads(selection.read_text())["step"] > step:
            shutil.rmtree(self.best)  # saved after the checkpoint we resumed from: not this run's
        return rows

    # ------------------------------------------------------------------ per step
    def append(self, row: dict, samples: list[dict]) -> None:
        """Add one step's row and its samples (flushed: a crash loses at most the step in flight)."""
        with open(self.steps, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        with open(self.samples, "a") as fh:
            fh.writelines(json.dumps(x) + "\n" for x in samples)

    def keep_if_best(self, model, row: dict, history: list[dict]) -> None:
        """With ``keep_best``: save the adapter when ``row``'s validation accuracy beats every one
        in ``history`` (the earlier steps)."""
        if not self.keep_best:
            return
        earlier = [r["val_accuracy"] for r in history if "val_accuracy" in r]
        if earlier and row["val_accuracy"] <= max(earlier) and self.best.exists():
            return
        selection = {"adapter": "best validation accuracy", "step": row["step"], "val_accuracy": row["val_accuracy"]}
        _replace(self.best, lambda tmp: _write_adapter(tmp, model, selection))

    # ------------------------------------------------------------------ the end
    def ship(self, dest: str | Path, model, tokenizer, history: list[dict]) -> dict:
        """Write the adapter the stage ships to ``dest`` (replacing it atomically), with the
        tokenizer and selection.json: the best validation adapter when ``keep_best`` saved one,
        else the current (last step's) weights of ``model``. Returns the selection."""
        dest = Path(dest)
        best = self.keep_best and self.best.exists()
        evals = [r for r in history if "val_accuracy" in r]
        last = {"adapter": "last step", "step": len(history), "val_accuracy": evals[-1]["val_accuracy"] if evals else None}

        def fill(tmp: Path) -> None:
            if best:
                shutil.copytree(self.best, tmp)
            else:
                _write_adapter(tmp, model, last, indent=2)
            tokenizer.save_pretrained(tmp)

        _replace(dest, fill)
        return json.loads((dest / "selection.json").read_text())


def _write_adapter(path: Path, model, selection: dict, indent: int | None = None) -> None:
    """The PEFT adapter of ``model`` and its ``selection.json`` written into the directory ``path``;
    the same weights are the same bytes in every process (``_sort_set_fields``)."""
    model.save_pretrained(path)
    for config in model.peft_config.values():
        _sort_set_fields(path / "adapter_config.json", config)
    (path / "selection.json").write_text(json.dumps(selection, indent=indent) + "\n")


def _sort_set_fields(file: Path, config) -> None:
    """Rewrite the set-valued fields of a PEFT config (``target_modules``) sorted in ``file``.

    PEFT writes them as ``list(set)`` (peft/config.py, ``save_pretrained``), an order that follows
    the process's string-hash seed, so two runs that train the same weights wrote different
    adapter_config.json files and DVC saw a different ``models/adapter``. The file keeps PEFT's
    own layout (indent 2, sorted keys, no final newline)."""
    data = json.loads(file.read_text())
    for key, value in vars(config).items():
        if isinstance(value, set) and key in data:
            data[key] = sorted(value)
    file.write_text(json.dumps(data, indent=2, sort_keys=True))


def _replace(dest: Path, fill) -> None:
    """``fill(tmp)`` writes a directory beside ``dest`` (``<dest>.tmp``), which then takes the place
    of ``dest`` by two renames (``dest`` to ``<dest>.old``, the new one to ``dest``), and only then
    is the old one deleted: until the new directory is complete ``dest`` is untouched, and a crash
    leaves the old directory or the new one, never a half-written one under ``dest``. A crash
    between the two renames leaves the old one as ``<dest>.old``; the next call puts it back first."""
    tmp, old = dest.with_name(dest.name + ".tmp"), dest.with_name(dest.name + ".old")
    if old.exists() and not dest.exists():
        old.rename(dest)  # an earlier swap stopped between its renames
    shutil.rmtree(tmp, ignore_errors=True)
    fill(tmp)
    shutil.rmtree(old, ignore_errors=True)
    if dest.exists():
        dest.rename(old)
    tmp.rename(dest)
    shutil.rmtree(old, ignore_errors=True)
