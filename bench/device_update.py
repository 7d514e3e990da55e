"""Seed 003's training update on a real card: CUDA's own memory counters at the preset's shapes.

The model is the preset's architecture with random weights (``grpo.tools.memory.resolve_config``: the
architecture ``grpo.tools.synthetic`` knows for ``model.name``; no download), saved and loaded back through
``grpo.model.lora_policy.load_policy`` as the train stage loads a base (bitsandbytes NF4, LoRA, gradient
checkpointing). The update is the one ``bench/cuda_memory.py`` traces on fake tensors, unchanged:
``PolicyPasses.fixed_logprobs`` then ``GRPOTrainer.update`` on random rollouts of
``prompts_per_step x group_size`` rows (``cuda_memory.make_trainer``), two steps; the figures are the
second's (AdamW's moments exist then). It prints and writes (``--json``) ``torch.cuda``'s
``max_memory_allocated`` / ``max_memory_reserved`` over that step, ``mem_get_info`` after it, and
``grpo check``'s training estimate for the same params (``grpo.tools.memory.estimate``), with their ratio.

``--entropy-rule RULE`` (and ``--top-quantile Q``) measures the update under another token rule than
the params' (the device check's ``rules`` phase: the default beside ``high`` at 0.2, the mask). On CUDA it also reads the memory outside
torch's allocator, ``total - free - reserved`` (``mem_get_info`` against ``memory_reserved``: the
CUDA context, the kernels' modules loaded so far, and anything another process holds on the card),
after CUDA starts, after the load, after the measured step's no-grad forward and after its update;
``--memory-cap-gib 7.6`` first caps torch's allocator there (``torch.cuda.set_per_process_memory_fraction``,
the device check's ``context`` phase: the allocator of an 8 GB card), the allowance ``grpo check``
adds as ``grpo.tools.memory.CUDA_CONTEXT``.

``--profile`` profiles one micro-batch of the second step with ``torch.profiler`` (CPU and, on CUDA,
CUDA activities): the ``PROFILED_CALL``-th call of ``PolicyPasses.loss_backward`` (a micro-batch's
forward with grad, the token rule's mask, the loss and its backward), in the step's steady state.
A window, not the whole step: the step runs about a million operators at seed 003's shapes (28
layers x 8 micro-batches x mu 2; the toy's 2 layers x 2 micro-batches dispatch about 23,000),
whose events the profiler would take tens of seconds to parse. Recorded (``PROFILE``): the
operators and kernels of most CUDA time (CPU time on a CPU), the window's CPU and CUDA time, its
kernel launches (the CUDA runtime's launch calls) and kernels run, the operators dispatched, the
calls of ``loss_backward`` in the step (the window times that many is the micro-batches' share of
the step; the threshold's no-grad pass and the optimizer are outside it), and the whole step's
wall and process CPU seconds and CUDA's peak allocated over it. On a CPU the CUDA figures are
null and the profiler still runs, so the fields are there. The JSON is written after the first
step too, so a run cut off keeps what it measured.

    python bench/device_update.py [--params presets/seed003.yaml] [--entropy-rule high] [--memory-cap-gib 7.6]
                                  [--profile] [--json FILE]
    python bench/device_update.py --dry-run    # on a CPU: the same code at toy sizes (no CUDA figures)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

SCHEMA = {
    "device": "str?: cuda, or cpu on --dry-run",
    "model": "str?: the architecture the weights were drawn for",
    "dtype": "str?: the compute dtype",
    "rows": "int?: completions in the step", "prompt_tokens": "int?: prompt length",
    "completion_tokens": "int?: completion length", "micro_batches": "int?: train.passes.micro_batches",
    "entropy_rule": "str?: train.loss.entropy_rule (its passes and LM-head rows with grad set the step's memory)",
    "top_quantile": "number?: that rule's top_quantile (1.0: every token)", "mu": "int?: train.optimizer.mu",
    "resident_gib": "number?: CUDA allocated before the first step (weights, quantisation state, LoRA)",
    "peak_allocated_gib": "number?: torch.cuda.max_memory_allocated over the second step",
    "reserved_after_load_gib": "number?: CUDA reserved after grpo.model.lora_policy.load_policy (which gives its load's cache back)",
    "peak_reserved_gib": "number?: torch.cuda.max_memory_reserved over the second step",
    "free_gib": "number?: torch.cuda.mem_get_info's free after the second step",
    "total_gib": "number?: torch.cuda.mem_get_info's total",
    "estimate_gib": "number?: grpo check's training figure for these params (grpo.tools.memory.estimate)",
    "ratio": "number?: peak allocated / estimate",
    "step_s": "number?: seconds of the second step's passes and update (with --profile, one micro-batch profiled inside)",
    "memory_cap_gib": "number?: --memory-cap-gib, torch's allocator capped there (CUDA only)",
    "outside_init_gib": "number?: total - free - reserved once CUDA has started (the context alone)",
    "outside_load_gib": "number?: the same after the load",
    "outside_forward_gib": "number?: the same after the second step's reference forward (PolicyPasses.fixed_logprobs; none without a KL term)",
    "outside_step_gib": "number?: the same after the second step's update (forward and backward kernels loaded)",
}
TOP = 12
"""Rows of the profile's tables."""
OPERATOR = {"name": "str: the operator or kernel", "cuda_ms": "number?: its self CUDA time over the step (null on a CPU)",
            "cpu_ms": "number: its self CPU time over the step", "calls": "int: how many times it ran"}
PROFILED_CALL = 2
"""The ``loss_backward`` call of the second step that is profiled (past its first micro-batch)."""
PROFILE = {
    "device": "str?: cuda, or cpu (no CUDA activity: the CUDA figures are null)",
    "window": "str?: what the profiler saw",
    "calls": "int?: PolicyPasses.loss_backward calls in the step (micro-batches x mu): the window's count",
    "window_s": "number?: the window's wall seconds, the profiler's overhead included",
    "step_s": "number?: the whole step's wall seconds (the window inside it)",
    "step_cpu_s": "number?: the whole step's process CPU seconds (time.process_time: every thread)",
    "cpu_ms": "number?: self CPU time of every operator in the window",
    "cuda_ms": "number?: self CUDA time of every kernel in the window",
    "launches": "int?: the CUDA runtime's kernel launch calls in the window (cudaLaunchKernel and the like)",
    "kernels": "int?: kernels (and copies) that ran on the card in the window",
    "operators": "int?: aten operators dispatched in the window (nested ones included)",
    "peak_allocated_gib": "number?: torch.cuda.max_memory_allocated over the whole step",
    "top_cuda": [OPERATOR],
    "top_cpu": [OPERATOR],
}
SCHEMA["profile"] = PROFILE
GiB = 2**30


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="presets/seed003.yaml", help="params file (a preset over params.yaml)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length (the preset's cap)")
    ap.add_argument("--entropy-rule", help="train.loss.entropy_rule to measure under (default: the params')")
    ap.add_argument("--top-quantile", type=float,
                    help="that rule's top_quantile (train.loss.entropy_rule_options.<rule>.top_quantile; default: the params')")
    ap.add_argument("--memory-cap-gib", type=float,
                    help="on CUDA: cap torch's allocator at this many GiB (set_per_process_memory_fraction)")
    ap.add_argument("--profile", action="store_true", help="one micro-batch of the second step under torch.profiler "
                                                           "(PROFILE)")
    ap.add_argument("--dry-run", action="store_true", help="CPU, a toy model, 8 new tokens: checks the script")
    ap.add_argument("--json", help="write the figures here")
    return ap.parse_args(argv)


def architecture(params_path: str, p, root: Path, dry_run: bool):
    """(transformers config, its name, device) of the weights to draw: the params' model
    (``grpo.tools.memory.resolve_config``) on CUDA; the ``toy`` architecture on the CPU with ``dry_run``
    (``bench/device_train.py`` draws its base the same way)."""
    from grpo.tools import memory
    from grpo.tools.synthetic import architecture_config

    if dry_run:
        return architecture_config("toy"), "toy", "cpu"
    found = memory.resolve_config(p.model, root)
    if isinstance(found, str):
        raise SystemExit(f"{params_path}: {found}")
    config, source = found
    return config, source, "cuda"


def setup(args):
    """(params, model config, architecture name, device) for the run."""
    from grpo.tools.cli import resolve_params

    res = resolve_params(args.params)
    p = res.params
    config, source, device = architecture(args.params, p, res.root, args.dry_run)
    update = {"loss": {"entropy_rule": args.entropy_rule}} if args.entropy_rule else {}
    if args.top_quantile is not None:
        rule = args.entropy_rule or p.train.loss.entropy_rule
        update.setdefault("loss", {})["entropy_rule_options"] = {rule: {"top_quantile": args.top_quantile}}
    if args.dry_run:
        update.update(rollouts={"max_new_tokens": 8, "prompts_per_step": 2, "group_size": 2}, passes={"micro_batches": 2})
    if update:
        from grpo.config.overlay import overlay_params
        from grpo.config.params import params_from_dict

        raw = p.model_dump()  # validated again: an unknown rule is one line, as in the params
        raw = overlay_params(raw, {"train": update})  # a part named merged key by key
        p = params_from_dict(raw)
    return p, config, source, device


def outside_allocator_gib(torch) -> float:
    """CUDA memory outside torch's allocator: ``total - free - reserved``."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (total - free - torch.cuda.memory_reserved()) / GiB


def blank_profile() -> dict:
    return {k: [] if isinstance(v, list) else None for k, v in PROFILE.items()}


def operator_rows(events, key: str, cuda: bool) -> list[dict]:
    """The ``TOP`` events of most ``key`` time (``self_device_time_total`` or ``self_cpu_time_total``)."""
    top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:TOP]
    return [{"name": e.key[:160], "cuda_ms": round(e.self_device_time_total / 1000, 3) if cuda else None,
             "cpu_ms": round(e.self_cpu_time_total / 1000, 3), "calls": int(e.count)} for e in top]


def profile_figures(prof, cuda: bool, torch) -> dict:
    """``PROFILE``'s window figures from a finished ``torch.profiler.profile``."""
    events = prof.key_averages()
    device_events = [e for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA]
    launch = [e for e in events if "LaunchKernel" in e.key or "GraphLaunch" in e.key]
    return {"cpu_ms": round(sum(e.self_cpu_time_total for e in events) / 1000, 3),
            "cuda_ms": round(sum(e.self_device_time_total for e in events) / 1000, 3) if cuda else None,
            "launches": sum(int(e.count) for e in launch) if cuda else None,
            "kernels": sum(int(e.count) for e in device_events) if cuda else None,
            "operators": sum(int(e.count) for e in events if e.key.startswith("aten::")),
            "top_cuda": operator_rows(device_events, "self_device_time_total", True) if cuda else [],
            "top_cpu": operator_rows(events, "self_cpu_time_total", cuda)}


def profiled_step(step, passes, cuda: bool, torch) -> tuple[float, dict]:
    """``step(True)`` with its ``PROFILED_CALL``-th ``passes.loss_backward`` call under
    ``torch.profiler`` (the method wrapped on this instance for the step, then given back):
    (the step's seconds, its ``PROFILE``)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    method, seen, window = passes.loss_backward, [], {}

    def loss_backward(*args, **kwargs):
        seen.append(1)
        if len(seen) != PROFILED_CALL:
            return method(*args, **kwargs)
        t0 = time.perf_counter()
        with profile(activities=activities) as prof:
            result = method(*args, **kwargs)
            if cuda:
                torch.cuda.synchronize()
        window.update(seconds=time.perf_counter() - t0, prof=prof)
        return result

    passes.loss_backward = loss_backward
    try:
        cpu0 = time.process_time()
        seconds = step(True)
        cpu_s = time.process_time() - cpu0
    finally:
        del passes.loss_backward  # the class's method again
    out = blank_profile() | {"device": "cuda" if cuda else "cpu", "calls": len(seen), "step_s": round(seconds, 4),
                             "step_cpu_s": round(cpu_s, 3)}
    if "prof" in window:
        out.update(window=f"PolicyPasses.loss_backward call {PROFILED_CALL} of {len(seen)} in the second step",
                   window_s=round(window["seconds"], 4), **profile_figures(window["prof"], cuda, torch))
    if cuda:
        out["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / GiB, 4)
    return seconds, out


def measure(args) -> dict:
    import torch

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from cuda_memory import make_trainer

    from grpo.core.device import compute_dtype
    from grpo.model.base_model import load_tokenizer
    from grpo.model.lora_policy import load_policy
    from grpo.tools import memory
    from grpo.tools.synthetic import random_model_dir
    from grpo.training.metrics import PhaseTimer

    p, config, source, device = setup(args)
    dtype = compute_dtype(p.model.dtype, device)
    cuda = device == "cuda"
    out = {k: None for k in SCHEMA} | {"profile": blank_profile()}

    def save(record: dict) -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(record, indent=1) + "\n")
    t = p.train
    out.update(device=device, model=str(source), dtype=str(dtype).removeprefix("torch."),
               rows=t.rollouts.prompts_per_step * t.rollouts.group_size, prompt_tokens=args.prompt_tokens,
               completion_tokens=t.rollouts.max_new_tokens, micro_batches=t.passes.micro_batches, entropy_rule=t.loss.entropy_rule,
               top_quantile=t.loss.rule_options().top_quantile, mu=t.optimizer.mu)
    if cuda:
        torch.cuda.init()
        if args.memory_cap_gib:
            total = torch.cuda.mem_get_info()[1]
            torch.cuda.set_per_process_memory_fraction(min(1.0, args.memory_cap_gib * GiB / total))
            out["memory_cap_gib"] = args.memory_cap_gib
        out["outside_init_gib"] = outside_allocator_gib(torch)
    with tempfile.TemporaryDirectory() as tmp:
        base = random_model_dir(Path(tmp) / "base", config, dtype=dtype, device=device)
        model_cfg = p.model.model_copy(update={"path": str(base)})
        model = load_policy(model_cfg, p.lora, device)
        tok = load_tokenizer(base)
        if cuda:  # load_training_base gives its load's cache back: reserved here is what the step starts from
            torch.cuda.synchronize()
            out["reserved_after_load_gib"] = torch.cuda.memory_reserved() / GiB
            out["resident_gib"] = torch.cuda.memory_allocated() / GiB
            out["outside_load_gib"] = outside_allocator_gib(torch)
        trainer, batch_of = make_trainer(model, tok, p, args.prompt_tokens, str(Path(tmp) / "run"), torch)

        def step(measured: bool) -> float:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            batch = trainer.passes.fixed_logprobs(batch_of())
            if cuda and measured:  # a sync the step does not have: the step's time includes it
                out["outside_forward_gib"] = outside_allocator_gib(torch)
            trainer.update(batch, trainer.passes.step_normalizer(batch.mask), batch.mask, PhaseTimer())
            del batch
            if cuda:
                torch.cuda.synchronize()
            return time.perf_counter() - t0

        step(False)
        save(out)
        if args.profile:  # the second step is measured (AdamW has moments then)
            out["step_s"], out["profile"] = profiled_step(step, trainer.passes, cuda, torch)
        else:
            out["step_s"], out["profile"] = step(True), blank_profile()
        if cuda:
            out["outside_step_gib"] = outside_allocator_gib(torch)
            free, total = torch.cuda.mem_get_info()
            out.update(peak_allocated_gib=torch.cuda.max_memory_allocated() / GiB,
                       peak_reserved_gib=torch.cuda.max_memory_reserved() / GiB,
                       free_gib=free / GiB, total_gib=total / GiB)

        shapes = memory.model_shapes(config, source)
        est = memory.estimate(p, shapes, "cuda", args.prompt_tokens)
        out["estimate_gib"] = est.total("train") / GiB
        if out["peak_allocated_gib"] is not None:
            out["ratio"] = out["peak_allocated_gib"] / out["estimate_gib"]
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}


def print_profile(prof: dict) -> None:
    if prof["step_s"] is None:
        return
    print(f"  profile: {prof['window']}: {prof['window_s']} s, CPU {prof['cpu_ms']} ms, CUDA {prof['cuda_ms']} ms, "
          f"{prof['launches']} launches, {prof['kernels']} kernels, {prof['operators']} aten operators; the step "
          f"{prof['step_s']} s wall, {prof['step_cpu_s']} s CPU, peak {prof['peak_allocated_gib']} GiB")
    for title, key in (("by CUDA time", "top_cuda"), ("by CPU time", "top_cpu")):
        for row in prof[key][:6]:
            print(f"    {title}: {row['name'][:90]}: CUDA {row['cuda_ms']} ms, CPU {row['cpu_ms']} ms, {row['calls']} calls")


def main(argv=None) -> dict:
    args = parse_args(argv)
    out = measure(args)
    print(f"{args.params}: {out['model']} (random weights), {out['dtype']}, {out['rows']} rows x "
          f"({out['prompt_tokens']} + {out['completion_tokens']}) tokens, {out['micro_batches']} micro-batches, "
          f"entropy rule {out['entropy_rule']} (top_quantile {out['top_quantile']}), mu {out['mu']}")
    for key in ("reserved_after_load_gib", "resident_gib", "peak_allocated_gib", "peak_reserved_gib", "free_gib", "total_gib", "estimate_gib",
                "ratio", "step_s", "memory_cap_gib", "outside_init_gib", "outside_load_gib", "outside_forward_gib",
                "outside_step_gib"):
        print(f"  {key:<20} {out[key]}")
    print_profile(out["profile"])
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


if __name__ == "__main__":
    main()
