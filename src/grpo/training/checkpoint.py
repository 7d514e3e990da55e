"""Checkpoints of a GRPO run: save, verify, load, resume, and the fingerprint that guards resume.

Layout of ``<output_dir>``::

    fingerprint                 hash of the params and data the checkpoints belong to
    steps.jsonl, samples.jsonl  per-step log and sampled completions (truncated on resume)
    checkpoints/
        step_000006/
            adapter.safetensors LoRA weights (PEFT state-dict names)
            state.pt            step, data position, optimizer, scheduler and RNG states: only
                                tensors, numbers, strings and plain containers
            manifest.json       written last: {"format": 1, "step": 6,
                                "files": {name: {"bytes": n, "sha256": hex}, ...}}
        step_000004/            the previous one (the two newest are kept)
        damaged/step_000008/    checkpoints that failed verification or loading, moved aside

Contract:

- ``save`` writes a checkpoint into ``.tmp_step_XXXXXX`` (manifest last, every file fsynced) and
  renames it to ``step_XXXXXX``, replacing a directory of that name, so a ``kill -9`` leaves the
  complete checkpoint or none; it then keeps the ``keep`` newest and removes stale temporaries.
- A checkpoint is *intact* when its manifest parses, has this format and the step of its
  directory name, lists the adapter and the state, and every listed file exists with the
  recorded size and sha256. ``read`` also loads it: the adapter with safetensors, the state with
  ``torch.load(weights_only=True)``, which refuses any pickled object other than tensors and
  plain containers *without running its code*; a refused or malformed state counts as damaged.
- ``load_latest`` (resume) tries the checkpoints newest first and returns the first that reads;
  each damaged one gets one warning naming its path and the reason and is moved aside to
  ``checkpoints/damaged/`` (so a later save of the same step is not blocked); when none reads it
  warns and returns ``None``: the run starts afresh from step 0.
- ``restore`` puts a read checkpoint into the model, optimizer, scheduler and RNGs; an intact
  checkpoint of other settings (adapter names or shapes) is a ``CheckpointMismatch``, not damage.
- ``reset_if_changed`` moves ``output_dir`` aside to ``<output_dir>.previous/`` (the
  ``PREVIOUS_RUNS_KEPT`` newest are kept) when the params that shape training or the training data
  differ from the ``fingerprint`` stored there: a checkpoint of another run is never continued, and
  never deleted at once.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

log = logging.getLogger(__name__)

FORMAT = 1
ADAPTER = "adapter.safetensors"
STATE = "state.pt"
MANIFEST = "manifest.json"
REQUIRED = (ADAPTER, STATE)
DAMAGED = "damaged"
KEEP = 2
FINGERPRINT = "fingerprint"
PREVIOUS_RUNS_KEPT = 3  # runs moved aside by reset_if_changed that are kept in <output_dir>.previous
_PREVIOUS_RUN = re.compile(r"\d{8}-\d{6}\.\d{6}_\w+")
_STEP_DIR = re.compile(r"step_(\d{6,})")
# train params that only place outputs, log, or spread the same update over processes (per-prompt
# sampling seeds: 1 or N processes take the same steps): changing them continues the same run
_NOT_FINGERPRINTED = ("checkpoints.every", "wandb", "metrics_dir", "adapter_dir", "distribution.num_processes",
                      "distribution.dist_timeout_s")
"""Train keys (dotted within the section) that only place outputs or log: left out of the fingerprint."""


class CheckpointError(Exception):
    """A damaged checkpoint: incomplete, altered, unreadable, or carrying objects the safe loader refuses."""


class CheckpointMismatch(RuntimeError):
    """An intact checkpoint that does not fit the run loading it (other LoRA or data settings)."""


@dataclass
class Checkpoint:
    """A checkpoint read from ``path`` and verified; not yet applied to any model."""

    path: Path
    step: int
    adapter: dict[str, torch.Tensor]  # PEFT name -> LoRA factor, (r, in) or (out, r)
    state: dict  # step, data_position, optimizer, scheduler, rng (see ``save``)

    @property
    def data_position(self) -> int:
        return self.state["data_position"]


# ---------------------------------------------------------------------------- RNG states
def rng_state() -> dict:
    """The torch (CPU and each CUDA device), numpy and python ``random`` generator states in types
    that ``torch.load(weights_only=True)`` accepts: tensors, lists, numbers, strings."""
    name, key, pos, has_gauss, cached = np.random.get_state()  # key: (624,) uint32
    version, internal, gauss_next = random.getstate()
    state = {
        "torch": torch.get_rng_state(),  # (S,) uint8
        "numpy": {"bit_generator": str(name), "key": key.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": [version, list(internal), gauss_next],
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()  # one (S,) uint8 per device
    return state


def set_rng_state(state: dict) -> None:
    """Inverse of ``rng_state``."""
    torch.set_rng_state(state["torch"])
    n = state["numpy"]
    np.random.set_state(
        (n["bit_generator"], np.asarray(n["key"], dtype=np.uint32), n["pos"], n["has_gauss"], n["cached_gaussian"])
    )
    version, internal, gauss_next = state["python"]
    random.setstate((version, tuple(internal), gauss_next))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# ---------------------------------------------------------------------------- layout
def step_name(step: int) -> str:
    return f"step_{step:06d}"


def _step_of(path: Path) -> int | None:
    m = _STEP_DIR.fullmatch(path.name)
    return int(m.group(1)) if m else None


def list_checkpoints(ckpt_dir: Path) -> list[Path]:
    """The ``step_XXXXXX`` directories in ``ckpt_dir``, oldest first (not verified)."""
    ckpt_dir = Path(ckpt_dir)
    if not ckpt_dir.is_dir():
        return []
    found = [p for p in ckpt_dir.iterdir() if p.is_dir() and _step_of(p) is not None]
    return sorted(found, key=_step_of)


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---------------------------------------------------------------------------- manifest
def _digest(path: Path) -> dict:
    with open(path, "rb") as fh:
        sha = hashlib.file_digest(fh, "sha256").hexdigest()
    return {"bytes": path.stat().st_size, "sha256": sha}


def write_manifest(path: Path, step: int) -> dict:
    """Record the size and sha256 of the checkpoint files in ``path`` (fsynced first) in
    ``path/manifest.json``, itself fsynced; return the manifest."""
    path = Path(path)
    for name in REQUIRED:
        _fsync(path / name)
    manifest = {"format": FORMAT, "step": step, "files": {name: _digest(path / name) for name in REQUIRED}}
    with open(path / MANIFEST, "w") as fh:
        json.dump(manifest, fh, indent=1)
        fh.flush()
        os.fsync(fh.fileno())
    return manifest


def verify(path: Path) -> dict:
    """The manifest of the checkpoint at ``path`` once its files match it; else ``CheckpointError``
    saying what is wrong (see the module docstring for what is checked)."""
    path = Path(path)
    try:
        manifest = json.loads((path / MANIFEST).read_bytes())
    except FileNotFoundError:
        raise CheckpointError(f"{MANIFEST} is missing") from None
    except (OSError, ValueError) as err:  # ValueError: bad JSON or bad UTF-8
        raise CheckpointError(f"{MANIFEST} is unreadable ({type(err).__name__})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"{MANIFEST} is not a format-{FORMAT} manifest")
    step, files = manifest.get("step"), manifest.get("files")
    if not isinstance(step, int) or step < 0 or (_step_of(path) is not None and step != _step_of(path)):
        raise CheckpointError(f"{MANIFEST} names step {step!r}, not the step of the directory")
    if not isinstance(files, dict) or not set(REQUIRED) <= set(files):
        raise CheckpointError(f"{MANIFEST} does not list {', '.join(REQUIRED)}")
    for name, expected in files.items():
        if not isinstance(name, str) or Path(name).name != name or not isinstance(expected, dict):
            raise CheckpointError(f"{MANIFEST} has a bad entry {name!r}")
        file = path / name
        if not file.is_file():
            raise CheckpointError(f"{name} is missing")
        size = file.stat().st_size
        if size != expected.get("bytes"):
            raise CheckpointError(f"{name} has {size} bytes, the manifest says {expected.get('bytes')}")
        if _digest(file)["sha256"] != expected.get("sha256"):
            raise CheckpointError(f"{name} does not match its sha256 in the manifest")
    return manifest


def _check_state(state, step: int) -> None:
    """``CheckpointError`` unless ``state`` has the structure ``save`` writes, for ``step``."""

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise CheckpointError(f"{STATE}: {what}")

    need(isinstance(state, dict), "not a dict")
    need(state.get("step") == step, f"step {state.get('step')!r}, the manifest says {step}")
    need(isinstance(state.get("data_position"), int), "no data position")
    opt = state.get("optimizer")
    need(isinstance(opt, dict) and isinstance(opt.get("state"), dict) and isinstance(opt.get("param_groups"), list),
         "no optimizer state")
    need(isinstance(state.get("scheduler"), dict), "no scheduler state")
    rng = state.get("rng")
    need(isinstance(rng, dict) and isinstance(rng.get("torch"), torch.Tensor) and rng["torch"].dtype == torch.uint8
         and isinstance(rng.get("numpy"), dict) and isinstance(rng.get("python"), list | tuple)
         and len(rng["python"]) == 3, "no RNG states")


# ---------------------------------------------------------------------------- save / read
def adapter_state(model) -> dict[str, torch.Tensor]:
    """The LoRA weights of a PEFT ``model`` on the CPU, contiguous (as safetensors wants them)."""
    from peft import get_peft_model_state_dict

    return {k: v.detach().cpu().contiguous() for k, v in get_peft_model_state_dict(model).items()}


def save(ckpt_dir: Path, step: int, model, optimizer, scheduler, *, data_position: int, keep: int = KEEP) -> Path:
    """Write ``ckpt_dir/step_XXXXXX`` atomically (see the module docstring) with the adapter of
    ``model``, the optimizer, scheduler and RNG states; keep the ``keep`` newest; return its path."""
    from safetensors.torch import save_file

    ckpt_dir = Path(ckpt_dir)
    final = ckpt_dir / step_name(step)
    tmp = ckpt_dir / f".tmp_{final.name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    save_file(adapter_state(model), tmp / ADAPTER)
    state = {
        "step": step,
        "data_position": data_position,
        "optimizer": optimizer.state_dict(),
        "scheduler": scheduler.state_dict(),
        "rng": rng_state(),
    }
    torch.save(state, tmp / STATE)
    write_manifest(tmp, step)  # last: a directory with a valid manifest is complete
    _fsync(tmp)
    if final.exists():  # the same step again, after a fall-back past it
        shutil.rmtree(final)
    tmp.rename(final)
    _fsync(ckpt_dir)
    for old in list_checkpoints(ckpt_dir)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    for stale in ckpt_dir.glob(".tmp_step_*"):  # left by a run killed while writing
        shutil.rmtree(stale, ignore_errors=True)
    return final


def read(path: Path, device: str | torch.device = "cpu") -> Checkpoint:
    """Verify the checkpoint at ``path`` and load its files (adapter onto ``device``, state on the
    CPU); ``CheckpointError`` if it is damaged or its state holds anything but plain data."""
    from safetensors.torch import load_file

    path = Path(path)
    manifest = verify(path)
    try:
        adapter = load_file(path / ADAPTER, device=str(device))
    except Exception as err:
        raise CheckpointError(f"{ADAPTER} is unreadable ({type(err).__name__}: {err})") from None
    try:
        state = torch.load(path / STATE, map_location="cpu", weights_only=True)
    except Exception as err:  # the safe unpickler refuses other globals before calling them
        first = str(err).strip().splitlines()[0] if str(err).strip() else ""
        raise CheckpointError(f"{STATE} refused by the weights-only loader ({type(err).__name__}: {first})") from None
    _check_state(state, manifest["step"])
    return Checkpoint(path, manifest["step"], adapter, state)


def quarantine(path: Path) -> Path:
    """Move the checkpoint at ``path`` to ``damaged/`` beside it (replacing an older copy of that
    name) and return the new path; it is deleted if it cannot be moved."""
    path = Path(path)
    dest = path.parent / DAMAGED / path.name
    shutil.rmtree(dest, ignore_errors=True)
    try:
        dest.parent.mkdir(exist_ok=True)
        path.rename(dest)
    except OSError:
        shutil.rmtree(path, ignore_errors=True)
        return path
    return dest


def latest(ckpt_dir: Path) -> Path | None:
    """The newest checkpoint in ``ckpt_dir`` that verifies (checksums only), without moving any."""
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            verify(path)
        except CheckpointError:
            continue
        return path
    return None


def load_latest(ckpt_dir: Path, device: str | torch.device = "cpu") -> Checkpoint | None:
    """Read the newest intact checkpoint in ``ckpt_dir``, newest first; each damaged one is
    logged once (path and reason) and moved aside. ``None`` when there is none to resume."""
    damaged = 0
    for path in reversed(list_checkpoints(ckpt_dir)):
        try:
            return read(path, device)
        except CheckpointError as err:
            damaged += 1
            moved = quarantine(path)
            log.warning("checkpoint %s is damaged: %s; moved to %s, falling back to the previous one",
                        path, err, moved)
    if damaged:
        log.warning("no intact checkpoint left in %s: starting afresh from step 0", ckpt_dir)
    return None


def restore(ckpt: Checkpoint, model, optimizer, scheduler) -> None:
    """Load ``ckpt`` into the PEFT ``model``, the optimizer, the scheduler and the RNGs;
    ``CheckpointMismatch`` (before changing anything) if its adapter has other names or shapes."""
    from peft import get_peft_model_state_dict, set_peft_model_state_dict

    expected = {k: tuple(v.shape) for k, v in get_peft_model_state_dict(model).items()}
    found = {k: tuple(v.shape) for k, v in ckpt.adapter.items()}
    if found != expected:
        raise CheckpointMismatch(f"{ckpt.path}: the adapter does not match the model's LoRA settings")
    set_peft_model_state_dict(model, ckpt.adapter)
    optimizer.load_state_dict(ckpt.state["optimizer"])
    scheduler.load_state_dict(ckpt.state["scheduler"])
    set_rng_state(ckpt.state["rng"])


# ---------------------------------------------------------------------------- logs
def truncate_jsonl(path: Path, step: int) -> list[dict]:
    """Keep the rows of the JSONL log ``path`` whose ``step`` is at most ``step``; return them."""
    path = Path(path)
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    rows = [r for r in rows if r["step"] <= step]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


# ---------------------------------------------------------------------------- fingerprint
def fingerprint(params) -> str:
    """Hash of everything a checkpoint depends on: the ``lora`` and ``train`` params (less those
    that only place outputs or log), the ``model`` params the train stage reads, and the bytes of
    the training data."""
    model = params.model
    keep = {"lora": params.lora.model_dump(), "train": params.train.model_dump(),
            "model": [model.path, model.quantization, model.dtype, model.gradient_checkpointing]}
    for key in _NOT_FINGERPRINTED:
        *parts, leaf = key.split(".")
        node = keep["train"]
        for part in parts:
            node = node[part]
        node.pop(leaf, None)
    digest = hashlib.sha256(json.dumps(keep, sort_keys=True).encode())
    digest.update(Path(params.train.data_path).read_bytes())
    return digest.hexdigest()[:16]


def previous_runs(out: Path) -> Path:
    """Where ``reset_if_changed`` moves the runs of ``out`` aside: ``<out>.previous`` beside it."""
    return out.with_name(out.name + ".previous")


def reset_if_changed(params) -> Path | None:
    """Resume only a run with the same fingerprint; otherwise move ``output_dir`` aside (a
    checkpoint of other params or data must never be continued, nor deleted) and start afresh.
    Leaves ``output_dir`` stamped. Returns where the earlier run went, or None.

    The earlier run goes to ``<output_dir>.previous/<time moved>_<its fingerprint>`` (one warning
    line naming it and how to restore it: its params and data back, and that folder renamed to
    ``output_dir`` in place of the new run's); of the runs there, the ``PREVIOUS_RUNS_KEPT`` most recently moved are kept
    and older ones deleted."""
    out = Path(params.train.output_dir)
    stamp = out / FINGERPRINT
    current = fingerprint(params)
    moved = None
    if out.exists() and (not stamp.exists() or stamp.read_text().strip() != current):
        moved = _move_aside(out, stamp.read_text().strip() if stamp.exists() else "")
        log.warning("params or data changed since the run in %s: starting afresh; the earlier run is now %s (to "
                    "continue it, put back its params and data and that folder in place of %s)", out, moved, out)
    out.mkdir(parents=True, exist_ok=True)
    tmp = stamp.with_name(FINGERPRINT + ".tmp")
    tmp.write_text(current + "\n")
    tmp.replace(stamp)
    return moved


def _move_aside(out: Path, stamp: str) -> Path:
    """Rename ``out`` into ``previous_runs(out)`` under a name that sorts by the time of the move;
    then delete all but the ``PREVIOUS_RUNS_KEPT`` newest runs there. Returns the new path."""
    parent = previous_runs(out)
    parent.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now()
    dest = parent / f"{now:%Y%m%d-%H%M%S.%f}_{stamp if re.fullmatch(r'[0-9a-f]{1,64}', stamp) else 'unstamped'}"
    out.rename(dest)
    runs = sorted(p for p in parent.iterdir() if _PREVIOUS_RUN.fullmatch(p.name))
    for old in runs[:-PREVIOUS_RUNS_KEPT]:
        shutil.rmtree(old, ignore_errors=True)
    return dest
