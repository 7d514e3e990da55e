"""The GPU check for a machine without network and without vLLM: everything but the engine, at seed
003's real shapes; the default phases in one command of at most 570 s (all of them: about three).

Two steps:

    python bench/device_check.py pack [DIR]          # here, with the package registry (default DIR .device-wheels)
    python3 bench/device_check.py run [OUT] --wheels DIR --commit SHA [--budget-s 570]   # there (OUT default: $OUT)
    python bench/device_check.py run OUT --dry-run [--phases all] [--without dvclive]   # on this CPU, toy sizes
    python bench/device_check.py budget                # the phases' budgets: need, limit, basis
    python bench/device_check.py validate OUT/device_check.json

``pack`` downloads the wheels the GPU image lacks (bitsandbytes, pydantic and its three helpers,
for CPython 3.12 on manylinux x86-64, at the versions this environment runs), cuts bitsandbytes'
wheel to its Python files and the CUDA 13.0 and CPU libraries (the image's torch is cu130), checks
that the folder is under ``CARRY_LIMIT_MIB`` and prints the command to run there, with ``--commit``
this tree's commit (``git rev-parse HEAD``, ``+dirty`` when the tree has changes): the device
machine's copy of the repository carries a stale ``.git``, so the JSON's ``commit`` is the one
passed (``commit_source`` says ``passed``, or ``git`` when read from the copy's own git).

``run`` runs the phases below in this order (``PHASES``; without ``--phases`` the five of
``DEFAULT_PHASES``, ``--phases all`` every one), each a child process under its own time limit
(``PHASES``, or ``--limit PHASE=SECONDS``, and never past ``--budget-s`` for the whole run; a phase
whose expected time, ``PHASES``' need, no longer fits in what is left is skipped, saying so). It
prints the budget table first (``budget`` prints it alone). After each phase it rewrites
``OUT/device_check.json`` (keys: ``SCHEMA`` below, the one home of the format), so a run cut short
still leaves what it measured; every phase's output goes to ``OUT/device_check.log`` under a header
line, and the tests' JUnit XML to ``OUT/pytest.xml`` (three files: a device call brings back at
most eight). A phase fails when its child exits non-zero or names an out-of-memory error, its
``why`` the line with the figure (``outcome``); the scripts record an OOM with its bytes
(``bench/oom.py``) and exit 1.

The default phases, most questions answered per second first:

1. ``probe``: Python, torch, the driver, the card and its compute capability, the C compiler and
   ``Python.h`` that Triton needs; installs the carried wheels into a ``--target`` folder; ``grpo
   doctor --params presets/seed003.yaml`` on the real card.
2. ``update``: seed 003's update at its real shapes on random weights (``bench/device_update.py
   --profile``): CUDA's peak allocated / reserved and free memory against ``grpo check``'s
   estimate; its second step under ``torch.profiler``: the top kernels by CUDA time, CPU time,
   launches, kernels and operators, the step's peak.
3. ``samplers``: SENT's and the evaluations' decode loop at seed 003's call sizes, as they run
   where vLLM is missing, each in a process of its own (``bench/sampler_calls.py``): seconds and
   peak memory per call against the prediction.
4. ``generation``: the loop training runs on CUDA at 16 rows x 512 tokens (``bench/decode_speed.py
   --variants`` ``GENERATION_VARIANTS``): the uncompiled static loop over its first tokens, then
   the compiled step on the persistent dense copies; milliseconds per token, the compile's first
   call, the share of rows with the same tokens.
5. ``train_stage``: the train stage whole (``bench/device_train.py``, the phase's limit its budget):
   ``tasks.train`` for 2 steps at seed 003's shapes on random weights: an unbroken run alone, then
   a run killed with -9 after its first checkpoint and resumed beside a second unbroken run (the
   adapters' bytes compared pair by pair); validation at the rollouts' compiled shape, the adapter
   and the dense export; its steps' seconds are seed 003's whole step through the decode loop
   ``auto`` picks.

The others (``--phases``): ``context`` (the memory outside torch's allocator with the allocator
capped at 7.6 GiB; skipped on a CPU), ``rules`` (the update under the params' token rule beside
``high``), ``deterministic`` (the train stage's unbroken run and two runs with
``train.deterministic: true``: they do not fit beside the resume lanes in one call), ``tests``
(``pytest -m cuda`` over ``NO_VLLM_TESTS``, with a JUnit XML), ``nan_guard`` (a real bf16 overflow
in the update), ``nf4_rows`` (bitsandbytes' NF4 kernels by row count), ``step`` (one GRPO step
through the decode loop at seed 003's call sizes, under ``high`` and under the params' rule).

Each phase's need and limit are ``bench/device_budgets.py``'s, derived there from what the phases
took on the H200 at d650e3f and the H100 (their JSON under docs/gpu-runs/): the default phases'
limits with ``RUN_MARGIN_S`` fill the default budget, 570 s, one device call.
``--without dvclive`` runs every phase as on a machine without dvclive (``hide_modules``), which the
GPU machine lacks: the train stage then logs one warning and goes on (``grpo.training.step_loggers``), and
``pack`` does not carry it (dvclive needs dvc and its dependencies).

``--dry-run`` runs the same plumbing on a CPU: toy sizes, Triton under ``TRITON_INTERPRET=1``, no
wheels, the limits and the default budget ``DRY_SCALE`` times longer; it checks the script and the
JSON, not a card. Exit 0 when every phase passed or was
skipped (the JSON says why), 1 when one failed or ran out of time, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import base64
import datetime
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path
from typing import NamedTuple

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "bench"
sys.path[:0] = [str(BENCH), str(REPO)]
import decode_speed  # noqa: E402  (each phase script holds its part of the schema)
import device_budgets  # noqa: E402  (the phases' needs and limits, from the cards' JSON)
import device_train  # noqa: E402
import device_update  # noqa: E402
import nan_guard  # noqa: E402
import nf4_rows  # noqa: E402
import sampler_calls  # noqa: E402
from report_schema import blank, schema_errors  # noqa: E402

from flows.process import StageTimeout, run_logged  # noqa: E402  (the one stop of a child's process tree)

SCHEMA_VERSION = "device_check/1"
CARRY_LIMIT_MIB = 48
"""The packed wheels' ceiling: a device call carries 64 MiB in all, the repository's tracked files
(about 2 MiB) and its untracked ones included."""
CARRIED = ("bitsandbytes", "pydantic", "pydantic-core", "annotated-types", "typing-inspection")
"""Distributions the GPU image lacks (its Python has torch, triton, transformers, peft, accelerate,
numpy, pytest, pyyaml, safetensors, tokenizers): fetched at the versions installed here."""
BNB_KEEP = ("libbitsandbytes_cuda130.so", "libbitsandbytes_cpu.so")
"""bitsandbytes' native libraries kept in the cut wheel: the image's torch is built for CUDA 13.0."""
NO_VLLM_TESTS = ("tests/test_kernels.py", "tests/test_cuda.py", "tests/test_logprobs.py")
"""The cuda-marked test files whose tests need no vLLM (the other cuda-marked files start engines)."""
SEED003 = "presets/seed003.yaml"
LOG = "device_check.log"

DEFAULT_PHASES = ("probe", "update", "samplers", "generation", "train_stage")
"""What ``run`` runs without ``--phases``, in this order: their limits and ``RUN_MARGIN_S`` sum to the
default budget, one device call (``device_budgets``; the last, ``train_stage``, gets what the others
leave and leaves out the parts that would not fit). ``--phases all``: every phase, about three calls."""
DEFAULT_BUDGET_S = 570
"""The run's default time limit: a device call may run 600 s."""
RUN_MARGIN_S = 5
"""Seconds a phase leaves of the budget (``Run.phase``): the report's last save and the summary."""
WHAT = {  # the default ones (DEFAULT_PHASES) first; their budgets: bench/device_budgets.py
    "probe": "versions, driver, card, compiler, Python.h; the carried wheels installed; grpo doctor",
    "update": "seed 003's update at its real shapes, its second step under torch.profiler: CUDA peak memory against "
              "grpo check, the top kernels by CUDA time, CPU time, launches",
    "samplers": "SENT's and the evaluations' decode loop (no vLLM) at seed 003's call sizes, each in its own process: "
                "seconds, peak memory against the prediction; an out-of-memory error fails the phase with its figure",
    "generation": "the decode loop as training runs it on CUDA at 16 rows x 512 tokens: the compiled step on the "
                  "persistent dense copies (its first call, the compile, timed apart), beside the uncompiled static "
                  "loop's first tokens; the same tokens",
    "train_stage": "tasks.train for 2 steps at seed 003's shapes (512 new tokens, validation at the rollouts' compiled "
                   "shape): an unbroken run, then a run killed with -9 after a checkpoint and resumed beside a second "
                   "unbroken run; validation, adapter and dense export",
    "context": "memory outside torch's allocator (total - free - reserved), the allocator capped at 7.6 GiB",
    "rules": "the update under the params' token rule beside high: peak memory and seconds",
    "deterministic": "the train stage's unbroken run and two runs with train.deterministic: true: the switch's cost "
                     "and whether it makes two runs equal",
    "tests": "pytest -m cuda on the test files that need no vLLM (the packed layout's included)",
    "nan_guard": "a bf16 overflow in the update: not applied, state unchanged, then the stop",
    "nf4_rows": "bitsandbytes NF4 at seed 003's linear shapes: M rows alone against the same rows of M=2048",
    "step": "one GRPO step through the decode loop at seed 003's call sizes, under high and under the params' rule",
}


class Phase(NamedTuple):
    limit_s: float
    """Seconds at most (``--limit`` changes it)."""
    need_s: float
    """Seconds it is expected to take on a card: with less left in the budget it is skipped (on
    ``--dry-run`` ``DRY_NEED_S``)."""
    what: str
    basis: str
    """Where the need comes from (``device_budgets.needs``)."""


TRAIN_MARGIN_S = 5
"""Seconds of a train phase's limit that ``bench/device_train.py``'s budget leaves: its last part's
save and its exit."""
BUDGETS = device_budgets.budgets(DEFAULT_PHASES, DEFAULT_BUDGET_S, RUN_MARGIN_S, TRAIN_MARGIN_S)
PHASES = {name: Phase(BUDGETS[name].limit_s, BUDGETS[name].need_s, what, BUDGETS[name].basis)
          for name, what in WHAT.items()}
GENERATION_VARIANTS = "dense-static,dense-static-graph"
"""``bench/decode_speed.py``'s variants in the generation phase: the loop ``auto`` picks on CUDA,
uncompiled (its first ``device_budgets.UNCOMPILED_TOKENS`` tokens) and compiled on the persistent
copies (the 4-bit and dynamic loops were measured at d650e3f)."""
DRY_SCALE = 3
"""On ``--dry-run`` the phases' own limits (``PHASES``) and the default budget are this many times
longer: the toy sizes run on a CPU at whatever speed it has (one shared with other work runs them
several times slower), and the dry run checks the plumbing, not the time; a ``--limit`` or
``--budget-s`` given is kept as given."""
DRY_NEED_S = 10
"""A phase's need on ``--dry-run`` (toy sizes: the floor below which no phase starts)."""
CONTEXT_CAP_GIB = 7.6
"""The context phase's allocator cap: seed 003's card (``grpo check --gpu-memory 7.6``)."""
RULE_BESIDE = ("high", 0.2)
"""The token rule and its ``top_quantile`` the rules phase measures beside the params' own: the mask,
the LM head with grad at its kept tokens only."""
PHASE = {
    "status": "str: passed | failed | timed out | skipped",
    "rc": "int?: the child's exit code (null: killed at its limit or not run)",
    "seconds": "number?: wall seconds", "limit_s": "number?: its time limit",
    "what": "str: what the phase checks",
    "why": "str?: why it was skipped or failed, one line",
}
BUDGET = {"need_s": "number: seconds expected on a card", "limit_s": "number: seconds at most",
          "basis": "str: where the need comes from (bench/device_budgets.py)"}
PEAK = {"measured_gib": "number?: CUDA's peak allocated in this run", "predicted_gib": "number?: the prediction beside it"}
PEAKS = {  # named as bench/cuda_memory.py --all --json names its traced calls
    "sent": "SENT's call: samplers.sent (peak_allocated_gib, predicted_gib)",
    "evaluation": "the evaluation's call: samplers.evaluate",
    "train_step": "the train stage's step: train_stage.unbroken.peak_allocated_gib against train_stage.estimate_gib",
}
SCHEMA = {
    "schema": f"str: this file's format ({SCHEMA_VERSION})",
    "dry_run": "bool: --dry-run (CPU, toy sizes: checks the script, not a card)",
    "commit": "str?: the commit that ran: --commit (pack prints it: git rev-parse HEAD, +dirty when the tree had "
              "changes), else this copy's git HEAD (+dirty); null without either",
    "commit_source": "str?: passed (--commit) or git (read here: stale in a device machine's copy); null without a commit",
    "started": "str: UTC start time, ISO 8601",
    "wall_s": "number: seconds so far",
    "budget_s": "number: the run's time limit",
    "budgets": {name: BUDGET for name in WHAT},
    "default_sum_s": "number: the default phases' limits and RUN_MARGIN_S (at most DEFAULT_BUDGET_S)",
    "peaks": {name: PEAK for name in PEAKS},
    "ok": "bool: every phase run passed",
    "finished": "bool: the run reached its end (false while it runs or when cut off)",
    "carried": "list[str]: the wheels installed from --wheels",
    "without": "list[str]: modules made unimportable for the phases (--without: as on a machine that lacks them)",
    "probe": {
        "python": "str: the Python version", "executable": "str: its path", "torch": "str: torch's version",
        "torch_cuda": "str?: the CUDA torch was built for", "device": "str: the card's name, or cpu",
        "capability": "str?: its compute capability", "memory_gib": "number?: its memory",
        "driver": "str?: the NVIDIA driver (grpo.rollout.engine.preflight.probe_driver)",
        "cc": "str?: the C compiler Triton would use (preflight.probe_compiler): its path and first line",
        "python_h": "str?: Python.h where Triton looks for it (preflight.probe_python_include), where found", "triton": "str?: triton's version",
        "transformers": "str?: its version", "peft": "str?: its version", "bitsandbytes": "str?: its version",
        "pydantic": "str?: its version", "doctor": "list[str]: grpo doctor's lines", "doctor_rc": "int?: its exit code",
    },
    "tests": {"passed": "int?: tests passed", "failed": "int?: failed or errors", "skipped": "int?: skipped",
              "failures": "list[str]: the failed tests' ids", "junit": "str?: the JUnit XML, in OUT"},
    "update": device_update.SCHEMA,
    "generation": decode_speed.SCHEMA,
    "train_stage": device_train.SCHEMA,
    "deterministic": device_train.SCHEMA,
    "rules": {
        "default_rule": "str?: the params' train.loss.entropy_rule",
        "default_from": "str?: update (the update phase's figures, this run) or rules (measured in this phase)",
        "default": device_update.SCHEMA,
        "high": device_update.SCHEMA,
        "peak_ratio": "number?: the default's peak allocated / high's",
        "step_ratio": "number?: the default's step seconds / high's",
    },
    "context": device_update.SCHEMA,
    "samplers": sampler_calls.SCHEMA,
    "nan_guard": nan_guard.SCHEMA,
    "nf4_rows": nf4_rows.SCHEMA,
    "step": "object?: bench/grpo_step.py's JSON (config, ours: its steps and phases)",
    "phases": {name: PHASE for name in WHAT},
}


# ------------------------------------------------------------------------------------- pack (here)
def installed_version(dist: str) -> str:
    from importlib.metadata import version

    return version(dist)


def download(dists: tuple[str, ...], dest: Path) -> list[Path]:
    """The wheels of ``dists`` at this environment's versions for CPython 3.12, manylinux x86-64."""
    specs = [f"{d}=={installed_version(d)}" for d in dists]
    platforms = [a for n in (17, 24, 27, 28, 34) for a in ("--platform", f"manylinux_2_{n}_x86_64")]
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(dest), *specs],
                   check=True)
    return sorted(dest.glob("*.whl"))


def record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def cut_wheel(wheel: Path, keep_native: tuple[str, ...]) -> None:
    """Rewrite ``wheel`` in place without the native libraries not named in ``keep_native`` (its
    RECORD rewritten to match, so pip installs it as any wheel)."""
    out = wheel.with_suffix(".cut")
    with zipfile.ZipFile(wheel) as src, zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED) as dst:
        record_name = next(n for n in src.namelist() if n.endswith(".dist-info/RECORD"))
        lines = []
        for name in src.namelist():
            if name == record_name or (name.endswith(".so") and Path(name).name not in keep_native):
                continue
            data = src.read(name)
            dst.writestr(name, data)
            lines.append(record_line(name, data))
        dst.writestr(record_name, "\n".join(lines + [f"{record_name},,"]) + "\n")
    out.replace(wheel)


def folder_mib(path: Path) -> float:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file()) / 2**20


def cmd_pack(args) -> int:
    dest = Path(args.dir)
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    wheels = download(CARRIED, dest)
    for wheel in wheels:
        if wheel.name.startswith("bitsandbytes-"):
            cut_wheel(wheel, BNB_KEEP)
    size = folder_mib(dest)
    for wheel in wheels:
        print(f"  {wheel.stat().st_size / 2**20:6.2f} MiB  {wheel.name}")
    if size > CARRY_LIMIT_MIB:
        print(f"device_check: {dest} holds {size:.1f} MiB, over the {CARRY_LIMIT_MIB} MiB a device call may carry "
              "beside the repository", file=sys.stderr)
        return 1
    print(f"device_check: {dest}: {len(wheels)} wheels, {size:.1f} MiB (limit {CARRY_LIMIT_MIB} MiB)")
    print(run_command(args.dir, git_commit()))
    return 0


def run_command(wheels: str, commit: str | None) -> str:
    """The line ``pack`` prints: the command to run there, naming this tree's commit."""
    named = f" --commit {commit}" if commit else ""
    return f"there: python3 bench/device_check.py run \"$OUT\" --wheels {wheels}{named}   (carry {wheels})"


def git_commit() -> str | None:
    """This tree's commit, ``git rev-parse HEAD``, with ``+dirty`` when the tree has changes
    (``git status --porcelain``: ignored files such as the wheels do not count); None without git."""
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=REPO, capture_output=True, text=True).stdout
        return head + ("+dirty" if dirty.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


# ------------------------------------------------------------------------------------- run (there)

def hide_modules(folder: Path, names: tuple[str, ...]) -> Path:
    """``folder`` holding, for each of ``names``, a package whose import raises
    ``ModuleNotFoundError`` as a module that is not installed does (``--without``): first on the
    children's PYTHONPATH, it makes ``import NAME`` fail through the real import machinery, as on a
    GPU machine that lacks it (dvclive there)."""
    for name in names:
        (folder / name).mkdir(parents=True, exist_ok=True)
        (folder / name / "__init__.py").write_text(
            f"raise ModuleNotFoundError(\"No module named '{name}' (hidden by device_check --without)\", name={name!r})\n")
    return folder


class Run:
    """One check: the report, the environment the children get, the time left."""

    def __init__(self, out: Path, budget_s: float, dry_run: bool, site: Path, limits: dict[str, float],
                 commit: str | None = None, without: tuple[str, ...] = ()):
        self.out, self.budget_s, self.dry_run, self.site, self.limits = out, budget_s, dry_run, site, limits
        self.t0 = time.monotonic()
        self.report = blank(SCHEMA)
        commit, source = (commit, "passed") if commit else (git_commit(), "git")
        self.report.update(schema=SCHEMA_VERSION, dry_run=dry_run, commit=commit, commit_source=source if commit else None,
                           budget_s=budget_s, started=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
                           ok=True, finished=False, without=list(without))
        for name, phase in PHASES.items():
            self.report["phases"][name].update(status="skipped", what=phase.what, why="not reached or not asked for")
            self.report["budgets"][name].update(need_s=phase.need_s, limit_s=phase.limit_s, basis=phase.basis)
        self.report["default_sum_s"] = sum(PHASES[n].limit_s for n in DEFAULT_PHASES) + RUN_MARGIN_S
        hidden = [str(hide_modules(site / "without", without))] if without else []
        path = os.pathsep.join([*hidden, str(REPO / "src"), str(REPO), str(site)]
                               + os.environ.get("PYTHONPATH", "").split(os.pathsep))
        self.env = {**os.environ, "PYTHONPATH": path.rstrip(os.pathsep), "PYTHONUNBUFFERED": "1",
                    "TQDM_DISABLE": "1", "WANDB_MODE": "disabled", "TOKENIZERS_PARALLELISM": "false"}
        if dry_run:
            self.env.update(TRITON_INTERPRET="1", GRPO_DEVICE="cpu")

    def left(self) -> float:
        return self.budget_s - (time.monotonic() - self.t0)

    def save(self) -> None:
        self.report["wall_s"] = round(time.monotonic() - self.t0, 1)
        self.report["peaks"] = peaks(self.report)
        tmp = self.out / "device_check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1) + "\n")
        tmp.replace(self.out / "device_check.json")

    def child(self, name: str, argv: list[str], limit: float) -> tuple[int | None, str]:
        """Run ``argv`` (``flows.process.run_logged``: its own session, its whole process tree
        stopped at ``limit`` seconds), each output line appended to ``OUT/LOG`` as it comes, under
        a header line. Returns (exit code, or None when stopped at the limit; its output)."""
        print(f"device_check: {name}: {' '.join(argv)} (at most {limit:.0f} s)", flush=True)
        with open(self.out / LOG, "a", encoding="utf-8") as fh:
            fh.write(f"\n===== {name}: {' '.join(argv)}\n")
            fh.flush()
            start = fh.tell()

            def write(line: str) -> None:
                fh.write(line + "\n")
                fh.flush()

            try:
                rc, _ = run_logged(argv, REPO, max(limit, 1), write, name, env=self.env)
            except StageTimeout as err:
                write(str(err))
                rc = None
        with open(self.out / LOG, "rb") as fh:
            fh.seek(start)
            text = fh.read().decode(errors="replace")
        sys.stdout.write("".join(f"  {line}\n" for line in text.splitlines()[-12:]))
        return rc, text

    def phase(self, name: str, body) -> None:
        """Run phase ``name`` (``body(limit)`` returns (status, rc, why)) and record it; skipped
        when the budget left is below what it needs (``Phase.need_s``)."""
        own = self.limits.get(name, PHASES[name].limit_s * (DRY_SCALE if self.dry_run else 1))
        need = min(DRY_NEED_S if self.dry_run else PHASES[name].need_s, own)
        left = self.left() - RUN_MARGIN_S
        limit = min(own, left)
        row = self.report["phases"][name]
        if left < max(need, DRY_NEED_S):
            row.update(status="skipped", why=f"the run's budget ({self.budget_s:.0f} s) has {max(left, 0):.0f} s "
                                             f"left, under the {need:.0f} s it needs")
            self.save()
            return
        t0 = time.monotonic()
        try:
            status, rc, why = body(limit)
        except Exception as err:  # a broken phase is recorded, and the next one runs
            status, rc, why = "failed", None, f"{type(err).__name__}: {err}"
        row.update(status=status, rc=rc, why=why, seconds=round(time.monotonic() - t0, 1), limit_s=round(limit))
        if status not in ("passed", "skipped"):  # a phase may skip itself, saying why (context on a CPU)
            self.report["ok"] = False
        print(f"device_check: {name}: {status}{f' ({why})' if why else ''} in {row['seconds']} s", flush=True)
        self.save()

    def script_json(self, name: str, argv: list[str], limit: float) -> tuple[tuple, dict | None]:
        """A bench script writing its JSON (``--json``) as a child of phase ``name``: (its
        ``outcome``, the JSON or None). A script cut off at its limit leaves what it wrote."""
        with tempfile.TemporaryDirectory() as tmp:
            result = Path(tmp) / f"{name}.json"
            rc, text = self.child(name, [sys.executable, *argv, "--json", str(result)], limit)
            data = json.loads(result.read_text()) if result.exists() else None
        return outcome(rc, text), data

    def script(self, name: str, argv: list[str], limit: float):
        """A phase that is one bench script writing its JSON, kept in the report under ``name``
        (one file back from the machine instead of one per phase)."""
        result, data = self.script_json(name, argv, limit)
        if data is not None:
            self.report[name] = data
        return result


def peaks(report: dict) -> dict:
    """``PEAKS``: each sampler call's and the train step's measured peak beside its prediction."""
    samplers, train = report["samplers"] or {}, report["train_stage"] or {}

    def call(row):
        return {"measured_gib": (row or {}).get("peak_allocated_gib"), "predicted_gib": (row or {}).get("predicted_gib")}
    return {"sent": call(samplers.get("sent")), "evaluation": call(samplers.get("evaluate")),
            "train_step": {"measured_gib": (train.get("unbroken") or {}).get("peak_allocated_gib"),
                           "predicted_gib": train.get("estimate_gib")}}


OOM_MARKS = ("OutOfMemoryError", "CUDA out of memory", "out of memory in ", "can't allocate memory")
"""Words of an out-of-memory error in a child's output: CUDA's type and message, the CPU allocator's,
and ``bench/oom.py``'s line."""


def outcome(rc: int | None, text: str) -> tuple[str, int | None, str | None]:
    """(status, rc, why) of a child. Exit 0 passes; otherwise why is its last line naming an
    out-of-memory error (the scripts' own summary line first: it carries the figures), else its
    last non-empty line. A child whose output names an out-of-memory error fails even on exit 0."""
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    oom = [line for line in lines if any(m in line for m in OOM_MARKS)]
    if rc is None:
        return "timed out", None, "killed at its time limit" + (f"; {oom[-1][:250]}" if oom else "")
    if rc == 0 and not oom:
        return "passed", 0, None
    summary = [line for line in oom if ": FAILED: " in line]
    why = (summary or oom or lines or [f"exit {rc}"])[-1]
    return "failed", rc, why[:300]


# ---- the phases
PROBE = r"""
import importlib.metadata as md, json, os, platform, subprocess, sys
import torch
from grpo.rollout.engine import preflight  # grpo doctor's own probes: the compiler and headers Triton would use
def ver(d):
    try:
        return md.version(d)
    except md.PackageNotFoundError:
        return None
cuda = torch.cuda.is_available()
cc = preflight.probe_compiler(os.environ)
header = preflight.probe_python_include() / "Python.h"
print(json.dumps({
    "python": platform.python_version(), "executable": sys.executable, "torch": torch.__version__,
    "torch_cuda": torch.version.cuda, "device": torch.cuda.get_device_name(0) if cuda else "cpu",
    "capability": ".".join(map(str, torch.cuda.get_device_capability(0))) if cuda else None,
    "memory_gib": round(torch.cuda.get_device_properties(0).total_memory / 2**30, 2) if cuda else None,
    "driver": preflight.probe_driver(),
    "cc": f"{cc}: " + subprocess.run([cc, "--version"], capture_output=True, text=True).stdout.splitlines()[0] if cc else None,
    "python_h": str(header) if header.exists() else None,
    **{d: ver(d) for d in ("triton", "transformers", "peft", "bitsandbytes", "pydantic")}}))
"""


def install_wheels(run: Run, wheels: Path | None, limit: float) -> list[str]:
    """Install the carried wheels into ``run.site`` (pip --target, no index, no dependencies)."""
    found = sorted(wheels.glob("*.whl")) if wheels else []
    if not found:
        return []
    rc, text = run.child("probe", [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                                   "--no-compile", "--upgrade", "--target", str(run.site), *map(str, found)], limit)
    if rc != 0:
        raise RuntimeError(f"pip could not install the wheels of {wheels} (exit {rc})")
    return [w.name for w in found]


def phase_probe(run: Run, wheels: Path | None):
    def body(limit):
        end = time.monotonic() + limit  # each child gets a share of what the ones before it left

        run.report["carried"] = install_wheels(run, wheels, (end - time.monotonic()) / 2)
        rc, text = run.child("probe", [sys.executable, "-c", PROBE], (end - time.monotonic()) * 0.4)
        if rc != 0:
            return outcome(rc, text)
        probe = json.loads([line for line in text.splitlines() if line.startswith("{")][-1])
        rc_doc, doc = run.child("probe", [sys.executable, "-m", "grpo.tools.cli", "doctor", "--params", SEED003],
                                end - time.monotonic())
        lines = [line for line in doc.split("grpo.tools.cli doctor", 1)[-1].splitlines()[1:] if line.strip()]
        run.report["probe"] = {**probe, "doctor": lines, "doctor_rc": rc_doc}
        if rc_doc is None:
            return "timed out", None, "grpo doctor was killed at its time limit"
        return "passed", 0, None  # doctor's verdict is recorded, not a failure of the probe
    run.phase("probe", body)


def junit_counts(path: Path) -> dict:
    import xml.etree.ElementTree as ET

    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root)
    count = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    failures = [f"{c.get('classname')}::{c.get('name')}" for c in root.iter("testcase")
                if c.find("failure") is not None or c.find("error") is not None]
    failed = count["failures"] + count["errors"]
    return {"passed": count["tests"] - failed - count["skipped"], "failed": failed, "skipped": count["skipped"],
            "failures": failures}


def phase_tests(run: Run):
    def body(limit):
        junit = run.out / "pytest.xml"
        rc, text = run.child("tests", [sys.executable, "-m", "pytest", "-m", "cuda", "-q", "-p", "no:cacheprovider",
                                       "-o", "addopts=-ra", "--junitxml", str(junit), *NO_VLLM_TESTS], limit)
        if junit.exists():
            run.report["tests"] = {**junit_counts(junit), "junit": junit.name}
        return outcome(rc, text)
    run.phase("tests", body)


def problems_file() -> Path:
    """Arithmetic prompts for the step phase (no reasoning-gym, no data set)."""
    path = Path(tempfile.gettempdir()) / "device_check_problems.jsonl"
    return device_train.write_rows(path, device_train.arithmetic_rows(64))


def ratio(a, b) -> float | None:
    return round(a / b, 4) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b else None


def phase_rules(run: Run, toy: list[str]):
    """The update under the params' rule beside ``RULE_BESIDE``: the default's figures are the
    update phase's when it passed in this run unprofiled (the same script and params), else measured
    here first (then each gets half the limit)."""
    def body(limit):
        t0 = time.monotonic()
        rules = run.report["rules"]
        update = run.report["update"]
        reuse = (run.report["phases"]["update"]["status"] == "passed" and update["entropy_rule"]
                 and update["profile"]["step_s"] is None)
        base = ["bench/device_update.py", "--params", SEED003, *toy]
        if reuse:
            rules.update(default=run.report["update"], default_from="update")
        else:
            (status, rc, why), data = run.script_json("rules", base, limit / 2)
            if data is not None:
                rules.update(default=data, default_from="rules")
            if status != "passed":
                return status, rc, f"the default rule: {why}"
        rules["default_rule"] = rules["default"]["entropy_rule"]
        rule, quantile = RULE_BESIDE
        result, data = run.script_json("rules", [*base, "--entropy-rule", rule, "--top-quantile", str(quantile)],
                                       limit if reuse else limit - (time.monotonic() - t0))
        if data is not None:
            rules["high"] = data
            rules.update(peak_ratio=ratio(rules["default"]["peak_allocated_gib"], data["peak_allocated_gib"]),
                         step_ratio=ratio(rules["default"]["step_s"], data["step_s"]))
        return result
    run.phase("rules", body)


def phase_context(run: Run, toy: list[str]):
    """The update with torch's allocator capped at ``CONTEXT_CAP_GIB``, for the memory outside
    it; on a CPU the script runs (at toy sizes, no CUDA figures) and the phase is skipped."""
    def body(limit):
        status, rc, why = run.script("context", ["bench/device_update.py", "--params", SEED003, *toy,
                                                 "--memory-cap-gib", str(CONTEXT_CAP_GIB)], limit)
        if status == "passed" and run.dry_run:
            return "skipped", rc, ("no CUDA device: the memory outside torch's allocator is a CUDA figure (the script "
                                   "ran at toy sizes)")
        return status, rc, why
    run.phase("context", body)


def phase_step(run: Run, toy: list[str]):
    shape = (["--arch", "toy", "--prompts", "2", "--group", "2", "--prompt-tokens", "24", "--new-tokens", "4",
              "--micro-batches", "2"] if run.dry_run else
             ["--arch", "qwen2-1.5b", "--prompts", "2", "--group", "8", "--prompt-tokens", "128", "--new-tokens", "512",
              "--micro-batches", "8"])
    run.phase("step", lambda limit: run.script(
        "step", ["bench/grpo_step.py", *shape, "--fixed-length", "--gradient-checkpointing", "--steps", "1",
                 "--rollout", "transformers", "--data", str(problems_file())], limit))


def train_phase(name: str, how: str):
    """A phase that is ``bench/device_train.py --deterministic how`` with the phase's limit as its
    budget (less ``TRAIN_MARGIN_S``; it counts from the script's start), so it leaves out the parts
    that would not fit instead of being killed in one. ``train_stage``: the resume and the kernels'
    lanes, no deterministic runs (they do not fit beside them in one call); ``deterministic``: the
    unbroken run and the two deterministic runs, in a call of their own."""
    def runner(run: Run, toy: list[str]):
        run.phase(name, lambda limit: run.script(name, [
            "bench/device_train.py", "--params", SEED003, "--budget-s", str(round(limit - TRAIN_MARGIN_S)),
            "--deterministic", how, *toy], limit))
    return runner


def one_script(name: str, script: str, *argv: str):
    """A phase that is ``script`` with ``argv`` (and ``--dry-run`` on a dry run), kept under ``name``."""
    return lambda run, toy: run.phase(name, lambda limit: run.script(name, [script, *argv, *toy], limit))


RUNNERS = {
    "update": one_script("update", "bench/device_update.py", "--params", SEED003, "--profile"),
    "generation": one_script("generation", "bench/decode_speed.py", "--params", SEED003, "--variants",
                             GENERATION_VARIANTS, "--uncompiled-tokens", str(device_budgets.UNCOMPILED_TOKENS)),
    "train_stage": train_phase("train_stage", "never"),
    "deterministic": train_phase("deterministic", "only"),
    "rules": phase_rules,
    "context": phase_context,
    "samplers": one_script("samplers", "bench/sampler_calls.py", "--params", SEED003),
    "tests": lambda run, toy: phase_tests(run),
    "nan_guard": lambda run, toy: run.phase("nan_guard", lambda limit: run.script("nan_guard", ["bench/nan_guard.py"],
                                                                                  limit)),
    "nf4_rows": one_script("nf4_rows", "bench/nf4_rows.py"),
    "step": phase_step,
}
"""Phase name -> ``runner(run, toy)`` (``probe`` apart: it takes the wheels)."""


def run_all(run: Run, wheels: Path | None, only: set[str]) -> None:
    """The phases of ``only`` in ``PHASES`` order (the probe always: it installs the wheels)."""
    toy = ["--dry-run"] if run.dry_run else []
    phase_probe(run, wheels)
    for name in PHASES:
        if name != "probe" and name in only:
            RUNNERS[name](run, toy)


def parse_limits(items: list[str]) -> dict[str, float] | None:
    """``--limit PHASE=SECONDS`` items as a dict; None when one is malformed."""
    out = {}
    for item in items:
        name, _, value = item.partition("=")
        try:
            out[name] = float(value)
        except ValueError:
            return None
    return out


def cmd_run(args) -> int:
    out = Path(args.out or os.environ.get("OUT") or "")
    if not str(out) or str(out) == ".":
        print("device_check: name the output folder (run OUT) or set $OUT", file=sys.stderr)
        return 2
    wheels = Path(args.wheels).resolve() if args.wheels else None
    if wheels is not None and not wheels.is_dir():
        print(f"device_check: --wheels {args.wheels}: no such folder (make it with: python bench/device_check.py "
              "pack)", file=sys.stderr)
        return 2
    only = set(PHASES) if args.phases == "all" else set(args.phases.split(",")) if args.phases else set(DEFAULT_PHASES)
    limits = parse_limits(args.limit)
    unknown = (only | set(limits or {})) - set(PHASES)
    if unknown or limits is None:
        what = f"unknown {', '.join(sorted(unknown))}" if unknown else "give PHASE=SECONDS"
        print(f"device_check: --phases/--limit: {what} (phases: {', '.join(PHASES)})", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    site = Path(tempfile.mkdtemp(prefix="device-check-site-"))
    budget = args.budget_s or DEFAULT_BUDGET_S * (DRY_SCALE if args.dry_run else 1)
    run = Run(out.resolve(), budget, args.dry_run, site, limits, args.commit, tuple(args.without))
    print_budgets()
    run.save()
    try:
        run_all(run, wheels, only)
    finally:
        run.report["finished"] = True
        run.save()
        shutil.rmtree(site, ignore_errors=True)
    print(f"  {'phase':<13} {'status':<10} {'seconds':>7} {'limit':>6}  why")
    for name, row in run.report["phases"].items():
        print(f"  {name:<13} {row['status']:<10} {row['seconds'] or 0:>7} {row['limit_s'] or '-':>6}  {row['why'] or ''}")
    print("  peaks (GiB, measured / predicted): " + "; ".join(
        f"{k} {v['measured_gib']} / {v['predicted_gib']}" for k, v in run.report["peaks"].items()))
    print(f"device_check: {'ok' if run.report['ok'] else 'FAILED'}: {out / 'device_check.json'}")
    return 0 if run.report["ok"] else 1


def print_budgets() -> None:
    """The budget table (``device_budgets``): each phase's need on a card, its limit, the basis."""
    print("device_check: the phases' budgets on a card (bench/device_budgets.py, from docs/gpu-runs/):")
    print("\n".join(device_budgets.table(BUDGETS, DEFAULT_PHASES, RUN_MARGIN_S)), flush=True)


def cmd_budget(args) -> int:
    print_budgets()
    return 0


def cmd_validate(args) -> int:
    errors = schema_errors(json.loads(Path(args.file).read_text()), SCHEMA)
    for e in errors:
        print(f"{args.file}: {e}")
    if not errors:
        print(f"{args.file}: conforms to {SCHEMA_VERSION}")
    return 1 if errors else 0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    pack = sub.add_parser("pack", help="download and cut the wheels to carry (here, with the package registry)")
    pack.add_argument("dir", nargs="?", default=".device-wheels")
    pack.set_defaults(func=cmd_pack)
    run = sub.add_parser("run", help="run the phases (there)")
    run.add_argument("out", nargs="?", help="output folder (default: $OUT)")
    run.add_argument("--wheels", help="the folder that pack made")
    run.add_argument("--commit", help="the commit that runs (pack prints it); default: this copy's git, which a "
                                      "device machine's copy has stale")
    run.add_argument("--budget-s", type=float, help=f"the whole run's time limit (default {DEFAULT_BUDGET_S}; "
                                                    f"on --dry-run {DRY_SCALE}x)")
    run.add_argument("--dry-run", action="store_true", help="on this CPU at toy sizes: checks the script")
    run.add_argument("--phases", help=f"comma-separated, of {','.join(PHASES)}, or all (default: "
                                      f"{','.join(DEFAULT_PHASES)}; the probe always runs)")
    run.add_argument("--without", action="append", default=[], metavar="MODULE",
                     help="make MODULE unimportable for every phase, as on a machine without it (repeatable; e.g. "
                          "dvclive, which the GPU machine lacks)")
    run.add_argument("--limit", action="append", default=[], metavar="PHASE=SECONDS",
                     help="a phase's own time limit instead of PHASES' (repeatable)")
    run.set_defaults(func=cmd_run)
    bud = sub.add_parser("budget", help="print the phases' budgets (needs, limits, their basis)")
    bud.set_defaults(func=cmd_budget)
    val = sub.add_parser("validate", help="check a device_check.json against SCHEMA")
    val.add_argument("file")
    val.set_defaults(func=cmd_validate)
    args = ap.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
