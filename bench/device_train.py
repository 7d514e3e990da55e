"""The train stage whole on a real card: ``tasks.train`` for a few steps at seed 003's shapes on random
weights, an unbroken run against one killed with -9 after its first checkpoint and resumed.

The base is the preset's architecture with random weights, drawn as ``bench/device_update.py`` draws
it (``device_update.architecture``, ``grpo.synthetic.random_model_dir``: no download); with
``--dry-run`` the ``toy`` architecture on the CPU at toy sizes. The params are the preset put over the
workspace's ``params.yaml`` (``grpo.overlay.overlay_params``, validated by ``grpo.params.params_from_dict``)
with, for this check (``STAGE_KEYS``): ``--steps`` N steps, a checkpoint every step, validation
(``eval_every``) at step N on ``VAL_ROWS`` problems of at most ``--eval-tokens`` new tokens, the decode
loop (``rollout_backend: transformers``), no warmup, truncated completions scored, and one reward
added, ``text_length`` (a completion's characters / 1000). Random weights score 0 on every built-in
reward (they write no number and no format), so every advantage would be 0, the update empty and
the adapter never moved from its start: the comparison below would hold whatever resume did. The
stage is therefore its own ``tasks.train.main`` (what ``python -m tasks.train --params FILE`` runs)
started as ``python -c`` after that one registration; nothing else differs.

Three processes of the stage, one after the other, then the dense export:

1. ``unbroken``: N steps in one process.
2. ``killed``: the same params in another folder; SIGKILL to its process group as soon as
   ``checkpoints/step_000001`` exists (``grpo.checkpoint.save`` renames a complete checkpoint into
   place, so its appearance is the moment after it was written).
3. ``resumed``: the same params file again: the stage resumes from the newest checkpoint (its
   ``resumed from`` line) and runs to step N.
4. ``dense_export``: ``grpo.lora_policy.export_dense`` of the unbroken run's adapter in this process,
   what the final evaluation writes (the train stage itself ships the PEFT adapter only).

Recorded (``--json``, rewritten after each part, so a run cut off keeps what it measured; keys:
``SCHEMA``): each process's seconds, steps, step and generation times and peak CUDA memory (the
step log's ``peak_mem_mb`` / ``peak_reserved_mb``, the largest step's; null on a CPU), its validation
accuracy at step N and whether its adapter was written; whether the resumed run's adapter has the
same bytes as the unbroken one's (sha256 of ``adapter_model.safetensors``) and otherwise the largest
absolute difference of their tensors. Equal bytes are recorded, not required: exit 0 when every
process ended as planned (``ok``), 1 otherwise.

    python bench/device_train.py [--params presets/seed003.yaml] [--steps 2] [--json FILE]
    python bench/device_train.py --dry-run    # on a CPU: the toy architecture at toy sizes
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
VAL_ROWS = 2
"""Validation problems: the path is the point, not the accuracy of random weights."""
RUN = {
    "rc": "int?: the process's exit code (-9: the kill)",
    "seconds": "number?: wall seconds of the process (start, load, steps, validation, adapter)",
    "steps": ["int: a step this process ran (its rows of the step log)"],
    "step_s": ["number: each of those steps' step_time_s"],
    "generate_s": ["number: each of those steps' time_generate_s (the decode loop)"],
    "peak_allocated_gib": "number?: the largest of those steps' torch.cuda.max_memory_allocated (peak_mem_mb); null on a CPU",
    "peak_reserved_gib": "number?: the same of torch.cuda.max_memory_reserved (peak_reserved_mb); null on a CPU",
    "val_accuracy": "number?: the validation logged at step N (eval_every), null when none",
    "adapter": "bool?: train.adapter_dir holds adapter_config.json and adapter_model.safetensors",
    "adapter_sha256": "str?: sha256 of its adapter_model.safetensors",
    "last_line": "str?: the last line of its output",
}
SCHEMA = {
    "device": "str?: cuda, or cpu on --dry-run",
    "model": "str?: the architecture the weights were drawn for",
    "dtype": "str?: the compute dtype",
    "steps": "int?: N, the steps of the unbroken and of the resumed run",
    "rows": "int?: completions per step", "prompt_tokens": "int?: the longest prompt of the data, in tokens",
    "completion_tokens": "int?: train.max_new_tokens", "micro_batches": "int?: train.micro_batches",
    "entropy_rule": "str?: train.entropy_rule", "eval_tokens": "int?: train.eval_max_new_tokens",
    "build_s": "number?: seconds to draw and save the random base",
    "unbroken": RUN, "killed": RUN, "resumed": RUN,
    "killed_after": "list[str]: the checkpoints there when the kill came",
    "resumed_from": "int?: the step the resumed run says it resumed from",
    "steps_complete": "bool?: the resumed run's step log holds steps 1..N, each once",
    "same_adapter_bytes": "bool?: the resumed run's adapter_model.safetensors has the unbroken run's bytes",
    "adapter_max_abs_diff": "number?: the largest |unbroken - resumed| over the adapter's tensors (0 when the bytes are equal)",
    "dense_export": {
        "seconds": "number?: grpo.lora_policy.export_dense of the unbroken run's adapter",
        "files": "list[str]: the weight files it wrote",
        "gib": "number?: their size",
        "peak_allocated_gib": "number?: torch.cuda.max_memory_allocated over the export; null on a CPU",
    },
    "ok": "bool?: every process ended as planned (exit 0; the killed one by the kill, after its first checkpoint), "
          "the resumed run resumed from a checkpoint with steps 1..N each once, validation at step N and the adapter in "
          "both completed runs, the dense export written",
}
STAGE = (
    "import sys\n"
    f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
    "from device_train import text_length\n"
    "from grpo.rewards import REWARDS\n"
    "REWARDS.register('text_length')(text_length)\n"
    "from tasks.train import main\n"
    "raise SystemExit(main(sys.argv[1:]))\n"
)
"""The stage's own main after one reward is registered (see the module docstring)."""


def text_length(completions: list[str], answers: list[str]) -> list[float]:
    """The reward added for this check: a completion's characters / 1000 (random weights' completions
    differ in it, so a group's advantages are not all 0)."""
    return [len(c) / 1000 for c in completions]
RESUMED = re.compile(r"resumed from (\S+) \(step (\d+)\)")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="presets/seed003.yaml", help="params file (a preset over params.yaml)")
    ap.add_argument("--steps", type=int, default=2, help="N, the steps of each completed run (at least 2)")
    ap.add_argument("--eval-tokens", type=int, default=64,
                    help="train.eval_max_new_tokens of the validation at step N (the path is checked, not its length)")
    ap.add_argument("--timeout-s", type=float, default=900, help="each process's time limit")
    ap.add_argument("--dry-run", action="store_true", help="CPU, the toy architecture, toy sizes: checks the script")
    ap.add_argument("--json", help="write the record here (rewritten after each part)")
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps: at least 2 (one step before the kill, one after the resume)")
    return args


def arithmetic_rows(n: int, prefix: str = "g") -> list[dict]:
    """``n`` arithmetic problems (no data set, no download)."""
    return [{"id": f"{prefix}{i}", "question": f"What is {i % 89 + 7} + {i % 13 + 3}?",
             "answer": str(i % 89 + 7 + i % 13 + 3), "solution": ""} for i in range(n)]


def write_rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def stage_params(args, work: Path, base: Path, folder: str) -> tuple[Path, dict]:
    """The params file of one run in ``work/folder`` and the validated train section (a dict): the
    preset over ``params.yaml``, the base at ``base``, ``STAGE_KEYS``; on ``--dry-run`` toy sizes."""
    import yaml

    from grpo.cli import workspace_root
    from grpo.config import read_params_yaml
    from grpo.overlay import overlay_params
    from grpo.params import params_from_dict

    preset = Path(args.params)
    root = workspace_root(preset)
    raw = read_params_yaml(preset)
    if (root / "params.yaml").is_file() and (root / "params.yaml").resolve() != preset.resolve():
        raw = overlay_params(read_params_yaml(root / "params.yaml"), raw)
    run = work / folder
    run.mkdir(parents=True, exist_ok=True)
    rewards = {**(raw.get("train") or {}).get("rewards", {"correctness": 1.0}), "text_length": 1.0}
    keys = {
        "steps": args.steps, "checkpoint_every": 1, "eval_every": args.steps, "eval_max_new_tokens": args.eval_tokens,
        "rollout_backend": "transformers", "warmup_steps": 0, "truncated": "score", "rewards": rewards,
        "wandb_mode": "disabled", "num_processes": 1,
        "data_path": str(work / "train.jsonl"), "val_path": str(work / "val.jsonl"),
        "output_dir": str(run / "out"), "adapter_dir": str(run / "adapter"), "metrics_dir": str(run / "metrics"),
    }
    if args.dry_run:
        keys.update(max_new_tokens=8, prompts_per_step=2, group_size=2, micro_batches=2)
    raw = overlay_params(raw, {"train": keys, "model": {"path": str(base)}})
    from grpo.rewards import REWARDS

    with REWARDS.registered("text_length", text_length):  # as in the stage's process; here for this check only
        train = params_from_dict(raw).train.model_dump()  # one line naming a bad key, before any process starts
    path = run / "params.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(raw)), sort_keys=False))
    return path, train


def stage_env() -> dict:
    path = os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1",
            "WANDB_MODE": "disabled"}


def start(params: Path, log: Path) -> subprocess.Popen:
    """The stage on ``params`` in a session of its own, its output to ``log``."""
    with open(log, "w") as fh:
        return subprocess.Popen([sys.executable, "-c", STAGE, "--params", str(params)], cwd=REPO, env=stage_env(),
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


def echo(name: str, log: Path) -> str:
    """Print a run's output under a header (the device check's log keeps it); the text."""
    text = log.read_text(errors="replace")
    print(f"--- {name}:", flush=True)
    print(text.rstrip(), flush=True)
    return text


def steps_of(run: Path) -> list[dict]:
    path = run / "out" / "steps.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


def sha256(path: Path) -> str | None:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else None


def record(rc, seconds: float, rows: list[dict], run: Path, text: str, n: int, cuda: bool) -> dict:
    """A ``RUN`` of one process: ``rows`` its rows of the step log."""
    def peak(key):
        values = [r[key] for r in rows if r.get(key) is not None]
        return round(max(values) / 1024, 4) if cuda and values else None

    adapter = run / "adapter"
    last = next((r for r in reversed(rows) if r["step"] == n and "val_accuracy" in r), None)
    lines = [line for line in text.splitlines() if line.strip()]
    return {"rc": rc, "seconds": round(seconds, 2), "steps": [r["step"] for r in rows],
            "step_s": [round(r.get("step_time_s") or 0.0, 3) for r in rows],
            "generate_s": [round(r.get("time_generate_s") or 0.0, 3) for r in rows],
            "peak_allocated_gib": peak("peak_mem_mb"), "peak_reserved_gib": peak("peak_reserved_mb"),
            "val_accuracy": last["val_accuracy"] if last else None,
            "adapter": (adapter / "adapter_config.json").exists() and (adapter / "adapter_model.safetensors").exists(),
            "adapter_sha256": sha256(adapter / "adapter_model.safetensors"), "last_line": lines[-1][:300] if lines else None}


def run_through(name: str, params: Path, run: Path, timeout: float, n: int, cuda: bool) -> tuple[dict, str]:
    """One process of the stage to its end (or ``timeout``): its ``RUN`` and output."""
    log = run / f"{name}.log"
    t0 = time.monotonic()
    proc = start(params, log)
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    seconds = time.monotonic() - t0
    text = echo(name, log)
    match = RESUMED.search(text)
    resumed = int(match.group(2)) if match else 0  # its rows: those after the step it resumed from
    rows = [r for r in steps_of(run) if r["step"] > resumed]
    return record(rc, seconds, rows, run, text, n, cuda), text


def run_killed(params: Path, run: Path, timeout: float, n: int, cuda: bool) -> tuple[dict, list[str]]:
    """The stage killed with SIGKILL (its process group) as soon as its first checkpoint exists."""
    log = run / "killed.log"
    ckpts = run / "out" / "checkpoints"
    t0 = time.monotonic()
    proc = start(params, log)
    deadline = t0 + timeout
    while proc.poll() is None and time.monotonic() < deadline and not any(ckpts.glob("step_*")):
        time.sleep(0.02)
    there = sorted(p.name for p in ckpts.glob("step_*"))
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    rc = proc.wait()
    return record(rc, time.monotonic() - t0, steps_of(run), run, echo("killed", log), n, cuda), there


def adapter_diff(a: Path, b: Path) -> float | None:
    """The largest |a - b| over two adapter files' tensors (None when their tensors differ in name or shape)."""
    from safetensors.torch import load_file

    ta, tb = load_file(a), load_file(b)
    if ta.keys() != tb.keys() or any(ta[k].shape != tb[k].shape for k in ta):
        return None
    return max(((ta[k].float() - tb[k].float()).abs().max().item() for k in ta), default=0.0)


def dense_export(model_cfg: dict, adapter: Path, out: Path, cuda: bool) -> dict:
    """``grpo.lora_policy.export_dense`` of ``adapter`` in this process, timed."""
    import torch

    from grpo.lora_policy import export_dense
    from grpo.sections.model import ModelConfig

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    done = export_dense(ModelConfig(**model_cfg), adapter, out)
    seconds = time.monotonic() - t0
    return {"seconds": round(seconds, 2), "files": done["files"],
            "gib": round(sum(f.stat().st_size for f in out.glob("*.safetensors")) / GiB, 4),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 4) if cuda else None}


def measure(args, save) -> dict:
    """Build, run the three processes and the export; ``save(out)`` after each part."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from device_update import architecture

    from grpo.base_model import load_tokenizer
    from grpo.cli import resolve_params
    from grpo.data import build_prompt
    from grpo.device import compute_dtype
    from grpo.synthetic import random_model_dir

    if args.dry_run:
        os.environ["GRPO_DEVICE"] = "cpu"  # this process's export and the stage's processes
    res = resolve_params(args.params)
    config, source, device = architecture(args.params, res.params, res.root, args.dry_run)
    cuda = device == "cuda"
    dtype = compute_dtype(res.params.model.dtype, device)
    out = {k: None for k in SCHEMA}
    out.update(killed_after=[], dense_export={k: None for k in SCHEMA["dense_export"]}, device=device,
               model=str(source), dtype=str(dtype).removeprefix("torch."), steps=args.steps, ok=False)
    out["dense_export"]["files"] = []
    n = args.steps
    with tempfile.TemporaryDirectory(prefix="device-train-") as tmp:
        work = Path(tmp)
        t0 = time.monotonic()
        base = random_model_dir(work / "base", config, dtype=dtype, device=device)
        out["build_s"] = round(time.monotonic() - t0, 2)
        if cuda:  # the stage's processes get the card whole
            import torch

            torch.cuda.empty_cache()
        tok = load_tokenizer(base)
        write_rows(work / "train.jsonl", arithmetic_rows(64))
        write_rows(work / "val.jsonl", arithmetic_rows(VAL_ROWS, "v"))
        params_a, t = stage_params(args, work, base, "unbroken")
        params_b, _ = stage_params(args, work, base, "killed")
        out.update(rows=t["prompts_per_step"] * t["group_size"], completion_tokens=t["max_new_tokens"],
                   micro_batches=t["micro_batches"], entropy_rule=t["entropy_rule"], eval_tokens=t["eval_max_new_tokens"],
                   prompt_tokens=max(len(tok(build_prompt(tok, r["question"], t["system_prompt"]),
                                             add_special_tokens=False)["input_ids"]) for r in arithmetic_rows(64)))
        save(out)
        run_a, run_b = work / "unbroken", work / "killed"

        out["unbroken"], _ = run_through("unbroken", params_a, run_a, args.timeout_s, n, cuda)
        save(out)
        out["killed"], out["killed_after"] = run_killed(params_b, run_b, args.timeout_s, n, cuda)
        save(out)
        out["resumed"], text = run_through("resumed", params_b, run_b, args.timeout_s, n, cuda)
        match = RESUMED.search(text)
        out["resumed_from"] = int(match.group(2)) if match else None
        out["steps_complete"] = [r["step"] for r in steps_of(run_b)] == list(range(1, n + 1))
        a, b = out["unbroken"]["adapter_sha256"], out["resumed"]["adapter_sha256"]
        if a and b:
            out["same_adapter_bytes"] = a == b
            out["adapter_max_abs_diff"] = 0.0 if a == b else adapter_diff(
                run_a / "adapter" / "adapter_model.safetensors", run_b / "adapter" / "adapter_model.safetensors")
        save(out)

        if out["unbroken"]["adapter"]:
            model_cfg = {**res.params.model.model_dump(), "path": str(base)}
            out["dense_export"] = dense_export(model_cfg, run_a / "adapter", work / "dense", cuda)
        completed = all(out[r]["rc"] == 0 and out[r]["adapter"] and out[r]["val_accuracy"] is not None
                        and out[r]["steps"] for r in ("unbroken", "resumed"))
        out["ok"] = bool(completed and out["killed"]["rc"] == -signal.SIGKILL and out["killed_after"]
                         and out["resumed_from"] and out["steps_complete"] and out["dense_export"]["files"])
        save(out)
    return out


def main(argv=None) -> int:
    args = parse_args(argv)

    def save(out: dict) -> None:
        if args.json:
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps(out, indent=1) + "\n")
            tmp.replace(args.json)

    out = measure(args, save)
    print(f"{args.params}: {out['model']} (random weights), {out['dtype']}, {out['rows']} rows x "
          f"({out['prompt_tokens']} + {out['completion_tokens']}) tokens, rule {out['entropy_rule']}, {out['steps']} steps")
    for name in ("unbroken", "killed", "resumed"):
        r = out[name]
        print(f"  {name:<9} rc {r['rc']}, {r['seconds']} s, steps {r['steps']}, step s {r['step_s']}, "
              f"peak allocated {r['peak_allocated_gib']} GiB, val {r['val_accuracy']}, adapter {r['adapter']}")
    print(f"  killed after {out['killed_after']}; resumed from step {out['resumed_from']}; steps complete "
          f"{out['steps_complete']}; same adapter bytes {out['same_adapter_bytes']} (max |diff| "
          f"{out['adapter_max_abs_diff']}); dense export {out['dense_export']['files']} in "
          f"{out['dense_export']['seconds']} s; ok {out['ok']}")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
