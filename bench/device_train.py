"""The train stage whole on a real card: ``tasks.train`` for a few steps at seed 003's shapes on random
weights, an unbroken run against one killed with -9 after its first checkpoint and resumed.

The base is the preset's architecture with random weights, drawn as ``bench/device_update.py`` draws
it (``device_update.architecture``, ``grpo.tools.synthetic.random_model_dir``: no download); with
``--dry-run`` the ``toy`` architecture on the CPU at toy sizes. The params are the preset put over the
workspace's ``params.yaml`` (``grpo.config.overlay.overlay_params``, validated by ``grpo.config.params.params_from_dict``)
with, for this check (``STAGE_KEYS``): ``--steps`` N steps, a checkpoint every step, validation
(``eval_every``) at step N on ``val_rows`` problems of at most ``--eval-tokens`` new tokens, the decode
loop (``rollout_backend: transformers``), no warmup, truncated completions scored, and one reward
added, ``text_length`` (a completion's characters / 1000). Random weights score 0 on every built-in
reward (they write no number and no format), so every advantage would be 0, the update empty and
the adapter never moved from its start: the comparison below would hold whatever resume did. The
stage is therefore its own ``tasks.train.main`` (what ``python -m tasks.train --params FILE`` runs)
started as ``python -c`` after that one registration; nothing else differs.

The parts, one process of the stage each:

1. ``unbroken``: N steps in one process, alone on the device (its step times are seed 003's step at
   its shapes).
2. ``dense_export``: ``grpo.model.lora_policy.export_dense`` of the unbroken run's adapter in this process,
   what the final evaluation writes (the train stage itself ships the PEFT adapter only).
3. Then two lanes, side by side where the device holds two stages at once (``two_lanes``: on CUDA
   when the memory free holds twice the unbroken run's reserved peak and ``CUDA_CONTEXT_GIB``; a
   CPU always), else one after the other, the resume lane first:

   * the resume lane: ``killed``, the same params in a folder of its own, SIGKILL to its process
     group as soon as ``checkpoints/step_000001`` exists (``grpo.training.checkpoint.save`` renames a
     complete checkpoint into place, so its appearance is the moment after it was written); then
     ``resumed``: the killed run's params file again, the stage resumes from the newest checkpoint
     (its ``resumed from`` line) and runs to step N;
   * the kernels' lane: ``unbroken_again``, the same params in another folder, N steps: two
     unbroken runs, so a difference of the resumed run can be told from the kernels' own
     run-to-run difference (running beside another process changes a kernel's time, not its
     arithmetic: the two lanes' seconds are not the step's, the unbroken run's are).
4. ``deterministic`` and ``deterministic_again``: two unbroken runs with ``train.deterministic: true``
   (``--deterministic``: ``auto`` when one of the pairs above differs, ``always``, ``never``, or
   ``only``: the unbroken run and these two, no resume lanes): the switch's cost (its step seconds
   against the unbroken run's) and whether it makes two runs equal.

Validation at step N samples ``val_rows`` problems, as many rows as a step's rollouts (the prompts
padded to a power of two, as a compiled step's call is: ``grpo.rollout.sampling.bucketed_call``), of
``--eval-tokens`` tokens (default the rollouts' ``max_new_tokens``): on CUDA, where the stage's
token steps reach ``decode.compile_min_tokens`` and the step is compiled, validation then reuses
the rollouts' compiled shape instead of compiling a second one in every process (``compiled``:
the shapes each process compiled, from its log).

``--budget-s`` counts from this process's start (the device check's phase limit starts there too):
a part starts only when its expected time (``EXPECTED``: a multiple of the unbroken run's seconds)
fits what is left; a part left out is named in ``skipped``, and a required one left out (the
unbroken again and the resumed run) makes ``ok`` false.

Recorded (``--json``, rewritten after each part, so a run cut off keeps what it measured; keys:
``SCHEMA``): each process's seconds, steps, step and generation times and peak CUDA memory (the
step log's ``peak_mem_mb`` / ``peak_reserved_mb``, the largest step's; null on a CPU), its validation
accuracy at step N and whether its adapter was written; for each pair (unbroken and unbroken again,
unbroken and resumed, the two deterministic runs) whether the adapters have the same bytes (sha256 of
``adapter_model.safetensors``) and otherwise the largest absolute difference of their tensors. Equal
bytes are recorded, not required: exit 0 when every process ended as planned (``ok``), 1 otherwise.

    python bench/device_train.py [--params presets/seed003.yaml] [--steps 2] [--budget-s S] [--json FILE]
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
import threading
import time
from pathlib import Path

STARTED = time.monotonic()
"""This process's start: ``--budget-s`` counts from here (before the imports and the base's build)."""
REPO = Path(__file__).resolve().parents[1]
GiB = 2**30
CUDA_CONTEXT_GIB = 1.0
"""A stage process's memory outside torch's allocator on CUDA, rounded up (the H200 measured 0.75 GiB:
docs/gpu-runs/2026-11-28-h200/device_check.json, update.outside_step_gib): ``two_lanes``' allowance."""
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
    "compiled": "list[str]: the decode step's shapes the process compiled, ROWSxPOSITIONS (its log's lines; none off CUDA)",
    "last_line": "str?: the last line of its output",
}
PAIR = {
    "same_bytes": "bool?: the two runs' adapter_model.safetensors have the same bytes (null: one did not write it)",
    "max_abs_diff": "number?: the largest |a - b| over the adapters' tensors (0 when the bytes are equal)",
}
SCHEMA = {
    "device": "str?: cuda, or cpu on --dry-run",
    "model": "str?: the architecture the weights were drawn for",
    "dtype": "str?: the compute dtype",
    "steps": "int?: N, the steps of the unbroken and of the resumed run",
    "rows": "int?: completions per step", "prompt_tokens": "int?: the longest prompt of the data, in tokens",
    "completion_tokens": "int?: train.rollouts.max_new_tokens", "micro_batches": "int?: train.passes.micro_batches",
    "entropy_rule": "str?: train.loss.entropy_rule", "eval_tokens": "int?: train.checkpoints.eval_max_new_tokens",
    "build_s": "number?: seconds to draw and save the random base",
    "setup_s": "number?: seconds from this process's start to the first part (imports, the base, the params): "
               "counted against --budget-s",
    "budget_s": "number?: --budget-s, the seconds all parts may take from this process's start (null: no limit)",
    "estimate_gib": "number?: grpo check's step peak for the unbroken run's params on this device "
                    "(grpo.tools.memory.estimate(...).peak), beside the runs' peak_allocated_gib",
    "val_rows": "int?: validation problems at step N (a step's rollout rows: the same compiled shape)",
    "lanes": "int?: the resume lane and the kernels' lane ran side by side (2) or one after the other (1)",
    "unbroken": RUN, "unbroken_again": RUN, "killed": RUN, "resumed": RUN,
    "deterministic": RUN, "deterministic_again": RUN,
    "killed_after": "list[str]: the checkpoints there when the kill came",
    "resumed_from": "int?: the step the resumed run says it resumed from",
    "steps_complete": "bool?: the resumed run's step log holds steps 1..N, each once",
    "same_adapter_bytes": "bool?: the resumed run's adapter_model.safetensors has the unbroken run's bytes",
    "adapter_max_abs_diff": "number?: the largest |unbroken - resumed| over the adapter's tensors (0 when the bytes are equal)",
    "unbroken_pair": PAIR,
    "deterministic_pair": PAIR,
    "deterministic_why": "str?: why the runs with train.deterministic: true ran or not, one line",
    "deterministic_step_ratio": "number?: the deterministic run's step seconds (summed) / the unbroken run's: the "
                                "switch's cost",
    "skipped": "list[str]: the parts left out for want of time (--budget-s) or by --deterministic only",
    "dense_export": {
        "seconds": "number?: grpo.model.lora_policy.export_dense of the unbroken run's adapter",
        "files": "list[str]: the weight files it wrote",
        "gib": "number?: their size",
        "peak_allocated_gib": "number?: torch.cuda.max_memory_allocated over the export; null on a CPU",
    },
    "ok": "bool?: every process ended as planned (exit 0; the killed one by the kill, after its first checkpoint), "
          "the resumed run resumed from a checkpoint with steps 1..N each once, validation at step N and the adapter in "
          "every completed run, the dense export written; no required part left out (with --deterministic only: "
          "the unbroken run, the export and the two deterministic runs)",
}
RUNS = ("unbroken", "unbroken_again", "killed", "resumed", "deterministic", "deterministic_again")
EXPECTED = {"unbroken_again": 1.0, "killed": 0.75, "resumed": 0.75, "deterministic": 1.5, "deterministic_again": 1.5}
"""A part's expected seconds as a multiple of the unbroken run's (the killed and resumed runs do
about half the steps but load the model and compile the step as often: 0.62 and 0.63 on the H200 at
128 tokens uncompiled, docs/gpu-runs/2026-11-28-h200/call2-train.json; deterministic algorithms are
slower: a guess until measured)."""
EXPORT_S = 5
"""Seconds a part leaves of the budget beyond its expected time: the record's last save and the exit
(the dense export, 7.5 s on an H200 at seed 003's size, runs before the lanes)."""
COMPILED = re.compile(r"compiled the step for (\d+) rows x (\d+) positions")
"""``grpo.rollout.sampling.timed_first_call``'s log line, once per process and shape."""
STAGE = (
    "import sys\n"
    f"sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})\n"
    "from device_train import text_length\n"
    "from grpo.algorithm.rewards import REWARDS\n"
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
    ap.add_argument("--eval-tokens", type=int,
                    help="train.checkpoints.eval_max_new_tokens of the validation at step N (default: the rollouts' "
                         "max_new_tokens, so that validation reuses the rollouts' compiled step)")
    ap.add_argument("--timeout-s", type=float, default=900, help="each process's time limit")
    ap.add_argument("--budget-s", type=float, help="the seconds all parts may take: a part that would not fit is "
                                                   "left out (default: no limit)")
    ap.add_argument("--deterministic", choices=("auto", "always", "never", "only"), default="auto",
                    help="the two runs with train.deterministic: true: auto when a pair differs (default); only: the "
                         "unbroken run and these two")
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


def stage_params(args, work: Path, base: Path, folder: str, **train_keys) -> tuple[Path, dict]:
    """The params file of one run in ``work/folder`` and the validated train section (a dict): the
    preset over ``params.yaml``, the base at ``base``, ``STAGE_KEYS``, then ``train_keys``; on
    ``--dry-run`` toy sizes."""
    import yaml

    from grpo.config.overlay import overlay_params
    from grpo.config.params import params_from_dict
    from grpo.config.reading import read_params_yaml
    from grpo.tools.cli import workspace_root

    preset = Path(args.params)
    root = workspace_root(preset)
    raw = read_params_yaml(preset)
    if (root / "params.yaml").is_file() and (root / "params.yaml").resolve() != preset.resolve():
        raw = overlay_params(read_params_yaml(root / "params.yaml"), raw)
    run = work / folder
    run.mkdir(parents=True, exist_ok=True)
    rewards = {**(raw.get("train") or {}).get("rewards", {"correctness": 1.0}), "text_length": 1.0}
    keys = {
        "steps": args.steps, "truncated": "score", "rewards": rewards, "data_path": str(work / "train.jsonl"),
        "output_dir": str(run / "out"), "adapter_dir": str(run / "adapter"), "metrics_dir": str(run / "metrics"),
        "checkpoints": {"every": 1, "eval_every": args.steps, "val_path": str(work / "val.jsonl")},
        "rollouts": {"backend": "transformers"}, "optimizer": {"warmup_steps": 0}, "wandb": {"mode": "disabled"},
        "distribution": {"num_processes": 1},
    }
    if args.dry_run:
        keys["rollouts"].update(max_new_tokens=8, prompts_per_step=2, group_size=2)
        keys["passes"] = {"micro_batches": 2}
    keys.update(train_keys)
    raw = overlay_params(raw, {"train": keys, "model": {"path": str(base)}})
    from grpo.algorithm.rewards import REWARDS

    with REWARDS.registered("text_length", text_length):  # as in the stage's process; here for this check only
        tokens = args.eval_tokens or params_from_dict(raw).train.rollouts.max_new_tokens  # the rollouts' shape
        raw = overlay_params(raw, {"train": {"checkpoints": {"eval_max_new_tokens": tokens}}})
        train = params_from_dict(raw).train.model_dump()  # one line naming a bad key, before any process starts
    path = run / "params.yaml"
    path.write_text(yaml.safe_dump(json.loads(json.dumps(raw)), sort_keys=False))
    return path, train


def val_rows(train: dict) -> int:
    """Validation problems whose call has a step's rollout shape: the step's prompts padded to a
    power of two (``grpo.rollout.sampling.bucketed_call``) times the group, one completion each."""
    r = train["rollouts"]
    return (1 << (r["prompts_per_step"] - 1).bit_length()) * r["group_size"]


ONE_THREAD = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "MKL_CBWR": "AUTO"}
"""A CPU stage process's environment on ``--dry-run``: one thread and MKL's reproducible mode. The
threaded CPU kernels of the torch wheel (MKL, oneDNN) do not promise one reduction order from one
process to the next (two unbroken dry runs' adapters differed on Intel Xeons and agreed on an AMD
EPYC: docs/lab-notebook.md). One thread each (the two lanes share the cores anyway) leaves no order
to the threads' scheduling, so the pairs compare by bytes on any CPU."""


def stage_env(cuda: bool = False) -> dict:
    path = os.pathsep.join([str(REPO / "src"), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "PYTHONUNBUFFERED": "1", "TQDM_DISABLE": "1",
            "WANDB_MODE": "disabled", **({} if cuda else ONE_THREAD)}


def start(params: Path, log: Path, cuda: bool = False) -> subprocess.Popen:
    """The stage on ``params`` in a session of its own, its output to ``log`` (on a CPU: ``ONE_THREAD``)."""
    with open(log, "w") as fh:
        return subprocess.Popen([sys.executable, "-c", STAGE, "--params", str(params)], cwd=REPO,
                                env=stage_env(cuda), stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)


ECHO = threading.Lock()
"""One run's output printed whole at a time (the lanes end side by side)."""


def echo(name: str, log: Path) -> str:
    """Print a run's output under a header (the device check's log keeps it); the text."""
    text = log.read_text(errors="replace")
    with ECHO:
        print(f"--- {name}:\n{text.rstrip()}", flush=True)
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
            "adapter_sha256": sha256(adapter / "adapter_model.safetensors"),
            "compiled": [f"{m.group(1)}x{m.group(2)}" for m in COMPILED.finditer(text)],
            "last_line": lines[-1][:300] if lines else None}


def run_through(name: str, params: Path, run: Path, timeout: float, n: int, cuda: bool) -> tuple[dict, str]:
    """One process of the stage to its end (or ``timeout``): its ``RUN`` and output."""
    log = run / f"{name}.log"
    t0 = time.monotonic()
    proc = start(params, log, cuda)
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
    proc = start(params, log, cuda)
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
    """``grpo.model.lora_policy.export_dense`` of ``adapter`` in this process, timed."""
    import torch

    from grpo.config.sections.model import ModelConfig
    from grpo.model.lora_policy import export_dense

    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.monotonic()
    done = export_dense(ModelConfig(**model_cfg), adapter, out)
    seconds = time.monotonic() - t0
    return {"seconds": round(seconds, 2), "files": done["files"],
            "gib": round(sum(f.stat().st_size for f in out.glob("*.safetensors")) / GiB, 4),
            "peak_allocated_gib": round(torch.cuda.max_memory_allocated() / GiB, 4) if cuda else None}


class Clock:
    """The time left of ``--budget-s`` (none: unlimited) from ``start`` (``time.monotonic``; default
    now) and what a part is expected to take."""

    def __init__(self, budget_s: float | None, start: float | None = None):
        self.start = time.monotonic() if start is None else start
        self.end = self.start + budget_s if budget_s else float("inf")

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.end - time.monotonic()

    def fits(self, part: str, unbroken_s: float | None) -> bool:
        """Whether ``part`` (``EXPECTED``) and ``EXPORT_S`` fit what is left."""
        return self.left() >= EXPECTED[part] * (unbroken_s or 0.0) + EXPORT_S


def pair(a: dict | None, b: dict | None, a_run: Path, b_run: Path) -> dict:
    """A ``PAIR``: the adapters of two runs (``RUN`` records, their folders) compared."""
    sa, sb = (a or {}).get("adapter_sha256"), (b or {}).get("adapter_sha256")
    if not (sa and sb):
        return {"same_bytes": None, "max_abs_diff": None}
    file = Path("adapter") / "adapter_model.safetensors"
    return {"same_bytes": sa == sb, "max_abs_diff": 0.0 if sa == sb else adapter_diff(a_run / file, b_run / file)}


def step_ratio(a: dict | None, b: dict | None) -> float | None:
    """Summed step seconds of run ``a`` over run ``b``'s (None without both)."""
    ta, tb = sum((a or {}).get("step_s") or []), sum((b or {}).get("step_s") or [])
    return round(ta / tb, 3) if ta and tb else None


def completed(r: dict) -> bool:
    return bool(r["rc"] == 0 and r["adapter"] and r["val_accuracy"] is not None and r["steps"])


class Parts:
    """The stage's processes of one check, each in its own folder under ``work``, and the record."""

    def __init__(self, args, work: Path, base: Path, out: dict, save, cuda: bool, clock: Clock):
        self.args, self.work, self.out, self.save, self.cuda, self.clock = args, work, out, save, cuda, clock
        made = {name: stage_params(args, work, base, name, deterministic=name.startswith("deterministic"))
                for name in ("unbroken", "unbroken_again", "killed", "deterministic", "deterministic_again")}
        self.params = {name: path for name, (path, _) in made.items()}
        self.train = made["unbroken"][1]
        """The unbroken run's train section (a dict): every run's but the deterministic switch."""
        self.lock = threading.Lock()
        """The record's writes and saves (the lanes run in threads)."""

    def timeout(self) -> float:
        return max(1.0, min(self.args.timeout_s, self.clock.left()))

    def keep(self, **items) -> None:
        """Set ``items`` in the record and save it (from either lane)."""
        with self.lock:
            self.out.update(items)
            self.save(self.out)

    def left_out(self, *names: str) -> None:
        with self.lock:
            self.out["skipped"] += list(names)

    def whole(self, name: str) -> bool:
        """Run ``name`` unbroken when it fits (``unbroken`` always); False when left out."""
        if name != "unbroken" and not self.clock.fits(name, self.out["unbroken"]["seconds"]):
            self.left_out(name)
            return False
        record, _ = run_through(name, self.params[name], self.work / name, self.timeout(), self.args.steps, self.cuda)
        self.keep(**{name: record})
        return True

    def again(self) -> None:
        """The kernels' lane: a second unbroken run, its adapter against the first's."""
        if self.whole("unbroken_again"):
            self.keep(unbroken_pair=pair(self.out["unbroken"], self.out["unbroken_again"], self.work / "unbroken",
                                         self.work / "unbroken_again"))

    def kill_and_resume(self) -> None:
        """The resume lane: the killed run, then the same params resumed; the resumed adapter against
        the unbroken one's."""
        out, run, n = self.out, self.work / "killed", self.args.steps
        if not self.clock.fits("killed", out["unbroken"]["seconds"]):
            self.left_out("killed", "resumed")
            return
        killed, after = run_killed(self.params["killed"], run, self.timeout(), n, self.cuda)
        self.keep(killed=killed, killed_after=after)
        if not self.clock.fits("resumed", out["unbroken"]["seconds"]):
            self.left_out("resumed")
            return
        resumed, text = run_through("resumed", self.params["killed"], run, self.timeout(), n, self.cuda)
        match = RESUMED.search(text)
        same = pair(out["unbroken"], resumed, self.work / "unbroken", run)
        self.keep(resumed=resumed, resumed_from=int(match.group(2)) if match else None,
                  steps_complete=[r["step"] for r in steps_of(run)] == list(range(1, n + 1)),
                  same_adapter_bytes=same["same_bytes"], adapter_max_abs_diff=same["max_abs_diff"])

    def lanes(self) -> None:
        """The resume lane and the kernels' lane, side by side where ``two_lanes`` says the device
        holds both, else the resume lane first."""
        two = two_lanes(self.cuda, self.out["unbroken"]["peak_reserved_gib"])
        self.keep(lanes=2 if two else 1)
        if not two:
            self.kill_and_resume()
            self.again()
            return
        threads = [threading.Thread(target=lane, name=lane.__name__) for lane in (self.kill_and_resume, self.again)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def deterministic_wanted(self) -> str | None:
        """Why the deterministic runs run (None: they do not, ``deterministic_why`` says why)."""
        out, how = self.out, self.args.deterministic
        differ = [name for name, same in (("unbroken_pair", out["unbroken_pair"]["same_bytes"]),
                                          ("unbroken and resumed", out["same_adapter_bytes"])) if same is False]
        if how == "never" or (how == "auto" and not differ):
            out["deterministic_why"] = ("--deterministic never" if how == "never" else
                                       "not needed: no pair's bytes differ")
            return None
        return f"--deterministic {how}" if how in ("always", "only") else f"bytes differ: {', '.join(differ)}"

    def deterministic(self) -> None:
        why = self.deterministic_wanted()
        if why is None:
            return
        ran = [name for name in ("deterministic", "deterministic_again") if self.whole(name)]
        out = self.out
        out["deterministic_why"] = f"{why}; ran {len(ran)} of 2" + (" (time)" if len(ran) < 2 else "")
        out["deterministic_step_ratio"] = step_ratio(out["deterministic"], out["unbroken"])
        out["deterministic_pair"] = pair(out["deterministic"], out["deterministic_again"],
                                         self.work / "deterministic", self.work / "deterministic_again")

    def export(self, model_cfg: dict) -> None:
        if self.out["unbroken"]["adapter"]:
            self.keep(dense_export=dense_export(model_cfg, self.work / "unbroken" / "adapter", self.work / "dense",
                                                self.cuda))

    def run_all(self, model_cfg: dict) -> None:
        out = self.out
        self.whole("unbroken")
        self.export(model_cfg)
        only = self.args.deterministic == "only"
        if only:
            self.left_out("unbroken_again", "killed", "resumed")
        else:
            self.lanes()
        self.deterministic()
        asked = ("deterministic", "deterministic_again") if only else ("unbroken_again", "resumed")
        resume_ok = only or (out["killed"]["rc"] == -signal.SIGKILL and out["killed_after"] and out["resumed_from"]
                             and out["steps_complete"])
        out["ok"] = bool(all(completed(out[r]) for r in ("unbroken", *asked)) and resume_ok
                         and out["dense_export"]["files"]
                         and all(completed(out[r]) for r in ("deterministic", "deterministic_again")
                                 if out[r]["rc"] is not None))
        self.save(out)


def two_lanes(cuda: bool, peak_reserved_gib: float | None) -> bool:
    """Whether two stage processes fit the device at once: a CPU always (the dry run checks the
    path); CUDA when the memory free now holds twice the unbroken run's reserved peak and
    ``CUDA_CONTEXT_GIB`` (an 8 GB card does not: one after the other there)."""
    if not cuda:
        return True
    if peak_reserved_gib is None:
        return False
    import torch

    return torch.cuda.mem_get_info()[0] / GiB >= 2 * (peak_reserved_gib + CUDA_CONTEXT_GIB)


def blank_record(args, device: str, source, dtype) -> dict:
    """The record before any part ran: a part not run keeps its ``RUN`` with every figure null."""
    out = {k: None for k in SCHEMA}
    for name in RUNS:
        out[name] = {k: [] if isinstance(v, list) or v.startswith("list[") else None for k, v in RUN.items()}
    out.update(killed_after=[], skipped=[], dense_export={k: None for k in SCHEMA["dense_export"]}, device=device,
               model=str(source), dtype=str(dtype).removeprefix("torch."), steps=args.steps, ok=False,
               budget_s=args.budget_s, unbroken_pair={k: None for k in PAIR},
               deterministic_pair={k: None for k in PAIR})
    out["dense_export"]["files"] = []
    return out


def step_estimate_gib(params_file: Path, config, source, device: str, prompt_tokens: int) -> float:
    """``grpo check``'s step peak (``grpo.tools.memory.estimate(...).peak``) for a run's params file."""
    import yaml

    from grpo.algorithm.rewards import REWARDS
    from grpo.config.params import params_from_dict
    from grpo.tools import memory

    with REWARDS.registered("text_length", text_length):
        p = params_from_dict(yaml.safe_load(params_file.read_text()))
    est = memory.estimate(p, memory.model_shapes(config, source), device, prompt_tokens)
    return round(est.peak / GiB, 4)


def measure(args, save, clock: Clock) -> dict:
    """Build the base, run the parts (``Parts``) against ``clock``; ``save(out)`` after each part."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from device_update import architecture

    from grpo.core.device import compute_dtype
    from grpo.data.sources import build_prompt
    from grpo.model.base_model import load_tokenizer
    from grpo.tools.cli import resolve_params
    from grpo.tools.synthetic import random_model_dir

    if args.dry_run:
        os.environ["GRPO_DEVICE"] = "cpu"  # this process's export and the stage's processes
    res = resolve_params(args.params)
    config, source, device = architecture(args.params, res.params, res.root, args.dry_run)
    cuda = device == "cuda"
    dtype = compute_dtype(res.params.model.dtype, device)
    out = blank_record(args, device, source, dtype)
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
        parts = Parts(args, work, base, out, save, cuda, clock)
        t = parts.train
        r = t["rollouts"]
        write_rows(work / "val.jsonl", arithmetic_rows(val_rows(t), "v"))
        prompt_tokens = max(len(tok(build_prompt(tok, row["question"], t["system_prompt"]),
                                    add_special_tokens=False)["input_ids"]) for row in arithmetic_rows(64))
        out.update(rows=r["prompts_per_step"] * r["group_size"], completion_tokens=r["max_new_tokens"],
                   val_rows=val_rows(t), micro_batches=t["passes"]["micro_batches"],
                   entropy_rule=t["loss"]["entropy_rule"], eval_tokens=t["checkpoints"]["eval_max_new_tokens"],
                   prompt_tokens=prompt_tokens,
                   estimate_gib=step_estimate_gib(parts.params["unbroken"], config, source, device, prompt_tokens),
                   setup_s=round(clock.elapsed(), 2))
        save(out)
        parts.run_all({**res.params.model.model_dump(), "path": str(base)})
    return out


def main(argv=None) -> int:
    args = parse_args(argv)

    def save(out: dict) -> None:
        if args.json:
            tmp = Path(args.json + ".tmp")
            tmp.write_text(json.dumps(out, indent=1) + "\n")
            tmp.replace(args.json)

    out = measure(args, save, Clock(args.budget_s, start=STARTED))
    print(f"{args.params}: {out['model']} (random weights), {out['dtype']}, {out['rows']} rows x "
          f"({out['prompt_tokens']} + {out['completion_tokens']}) tokens, rule {out['entropy_rule']}, {out['steps']} steps")
    for name in RUNS:
        r = out[name]
        if r["rc"] is not None:
            print(f"  {name:<19} rc {r['rc']}, {r['seconds']} s, steps {r['steps']}, step s {r['step_s']}, peak "
                  f"allocated {r['peak_allocated_gib']} GiB, val {r['val_accuracy']}, adapter {r['adapter']}, "
                  f"compiled {r['compiled']}")
    u, d = out["unbroken_pair"], out["deterministic_pair"]
    print(f"  unbroken again: same adapter bytes {u['same_bytes']} (max |diff| {u['max_abs_diff']})")
    print(f"  killed after {out['killed_after']}; resumed from step {out['resumed_from']}; steps complete "
          f"{out['steps_complete']}; same adapter bytes {out['same_adapter_bytes']} (max |diff| "
          f"{out['adapter_max_abs_diff']})")
    print(f"  deterministic: {out['deterministic_why']}; same adapter bytes {d['same_bytes']} (max |diff| "
          f"{d['max_abs_diff']}); step seconds x{out['deterministic_step_ratio']} of the unbroken run's")
    print(f"  dense export {out['dense_export']['files']} in {out['dense_export']['seconds']} s; lanes {out['lanes']}; "
          f"skipped {out['skipped']}; ok {out['ok']}")
    if not out["ok"]:  # the last line: what the device check's phase reports as why
        bad = [f"{n}: rc {out[n]['rc']}, {out[n]['last_line']}" for n in RUNS
               if out[n]["rc"] not in (None, 0) and not (n == "killed" and out[n]["rc"] == -signal.SIGKILL)]
        print(f"device_train: FAILED: {'; '.join(bad) or 'skipped ' + ', '.join(out['skipped'])}", flush=True)
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
