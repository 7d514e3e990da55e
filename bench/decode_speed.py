"""The decode loop's speed without vLLM, before and after, at seed 003's call size on a real card.

The model is the params' architecture with random weights, loaded as the train stage loads its
base (bitsandbytes NF4 + LoRA, ``bench/device_update.py``'s ``setup``). Each variant samples
``--rows`` completions (groups of ``train.rollouts.group_size``, one random prompt of ``--prompt-tokens``
per group) of exactly ``--new-tokens`` tokens (EOS suppressed), each completion from its own seed,
and is timed whole (prefill, dense copies, every decode step):

* ``nf4-dynamic``: the loop CUDA ran before (4-bit layers, LoRA unmerged, rows leave the batch, a
  host sync and a growing mask per token), over ``--before-tokens`` tokens (it is the slow one);
* ``dense-dynamic``: the same loop on the dense copies with LoRA folded in
  (``grpo.model.nf4_layers.dequantized_weights``);
* ``dense-static``: the static loop (``grpo.rollout.sampling``: ``StaticCache``, fixed shapes, EOS checked
  every 16 tokens) on the dense copies, what ``auto`` runs on CUDA where the copies fit;
* ``dense-static-graph``: the same with the step captured as a CUDA graph (``compile_step``; CUDA
  only: its first call compiles, so it is timed on a second call), on the persistent dense copies
  (``dequantized_weights(persistent=True)``, refilled in place at each call) as training's
  rollouts run it (``grpo.rollout.rollout_backends.TransformersBackend``: the compiled step holds the
  copies' addresses, so fresh copies each call would recompile it).

Per variant: seconds, milliseconds per token (seconds / tokens), and the share of rows whose
tokens equal the reference's: ``dense-dynamic``'s, or without it the first variant run's (same
seeds; bf16 rounding may differ with the batch's shape, and a compiled step's kernels round apart;
compared over the shorter length, so ``--uncompiled-tokens`` may make the uncompiled variants short).
A variant that fails is recorded (``error``, an out-of-memory error with its figures: ``bench/oom.py``)
and the next still runs; the script then exits 1, its last line naming each failure.
``--profile`` adds a ``torch.profiler`` split of ``--profile-tokens`` tokens for the first and the
last variant run: CPU and CUDA self time per token, kernel launches per token, the top operators.
The JSON is rewritten after each variant, so a run cut off keeps what it measured.

    python bench/decode_speed.py [--params presets/seed003.yaml] [--rows 16] [--new-tokens 512] [--uncompiled-tokens 64]
                                 [--profile] [--json FILE]
    python bench/decode_speed.py --dry-run    # on a CPU: the toy model, a few tokens (checks the script)
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_update  # noqa: E402  (the params' architecture, drawn at random, as the update check does)
import oom  # noqa: E402

VARIANTS = {  # name -> (dense copies, loop, compile the step)
    "nf4-dynamic": (False, "dynamic", False),
    "dense-dynamic": (True, "dynamic", False),
    "dense-static": (True, "static", False),
    "dense-static-graph": (True, "static", True),
}
VARIANT = {
    "tokens": "int?: tokens per completion", "seconds": "number?: the call's wall seconds (the second call for a graph)",
    "ms_per_token": "number?: seconds / tokens, in ms: one decode step of every row",
    "first_call_s": "number?: the first call's seconds (compilation included), graph variant only",
    "same_tokens": "number?: share of rows equal to the reference's over the shorter length (same seeds): "
                   "dense-dynamic's, else the first variant run's (null for the reference itself)",
    "peak_allocated_gib": "number?: CUDA's max_memory_allocated during the call",
    "persistent": "bool?: the dense copies were the persistent ones (the compiled step's, as training runs it)",
    "error": "str?: why the variant did not run, one line",
    **oom.SCHEMA,
}
PROFILE = {
    "variant": "str?: the variant profiled", "tokens": "int?: tokens profiled",
    "cpu_ms_per_token": "number?: self CPU time of every operator / tokens",
    "cuda_ms_per_token": "number?: self CUDA time of every kernel / tokens",
    "launches_per_token": "number?: CUDA kernels launched / tokens",
    "top": "list[str]: the five operators of most self CUDA time (CPU time on a CPU): name, ms, calls",
}
SCHEMA = {
    "device": "str?: cuda, or cpu on --dry-run", "model": "str?: the architecture the weights were drawn for",
    "dtype": "str?: the compute dtype", "rows": "int?: completions per call", "group": "int?: completions per prompt",
    "prompt_tokens": "int?: prompt length",
    "variants": {name: VARIANT for name in VARIANTS},
    "profile_before": PROFILE, "profile_after": PROFILE,
    "speedup": "number?: nf4-dynamic's ms per token / the fastest variant's",
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="presets/seed003.yaml", help="params file (a preset over params.yaml)")
    ap.add_argument("--rows", type=int, default=16, help="completions per call")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length")
    ap.add_argument("--new-tokens", type=int, default=512, help="tokens per completion")
    ap.add_argument("--before-tokens", type=int, default=64, help="tokens per completion of nf4-dynamic")
    ap.add_argument("--uncompiled-tokens", type=int,
                    help="tokens per completion of dense-dynamic and dense-static (default: --new-tokens)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated, in this order")
    ap.add_argument("--profile", action="store_true", help="profile the first and the last variant")
    ap.add_argument("--profile-tokens", type=int, default=16)
    ap.add_argument("--dry-run", action="store_true", help="CPU, the toy model, 8 tokens: checks the script")
    ap.add_argument("--json", help="write the figures here (after each variant)")
    args = ap.parse_args(argv)
    args.entropy_rule = args.top_quantile = None  # device_update.setup's other knobs
    if args.dry_run:
        args.rows, args.prompt_tokens, args.new_tokens, args.before_tokens, args.profile_tokens = 4, 16, 8, 8, 4
        args.uncompiled_tokens = min(args.uncompiled_tokens or 8, 8)
    unknown = [v for v in args.variants.split(",") if v not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {', '.join(unknown)} (known: {', '.join(VARIANTS)})")
    return args


class Model:
    """The policy and what every variant's call needs."""

    def __init__(self, args, tmp: Path):
        import torch

        from grpo.core.device import compute_dtype
        from grpo.model.lora_policy import load_policy
        from grpo.tools.synthetic import random_model_dir

        p, config, self.source, self.device = device_update.setup(args)
        self.dtype = compute_dtype(p.model.dtype, self.device)
        base = random_model_dir(tmp / "base", config, dtype=self.dtype, device=self.device)
        self.policy = load_policy(p.model.model_copy(update={"path": str(base)}), p.lora, self.device).eval()
        self.group = min(p.train.rollouts.group_size, args.rows)
        prompts = max(1, args.rows // self.group)
        gen = torch.Generator().manual_seed(0)
        self.ids = torch.randint(10, config.vocab_size, (prompts, args.prompt_tokens), generator=gen).to(self.device)
        self.mask = torch.ones_like(self.ids)
        self.rows = prompts * self.group
        self.seeds = list(range(self.rows))

    def sample(self, tokens: int, dense: bool, loop: str, compile_step: bool):
        """One call's (N, tokens) completion ids, as ``TransformersBackend.generate`` samples them."""
        import contextlib

        from grpo.model.nf4_layers import dequantized_weights
        from grpo.rollout.sampling import DECODE_LOOPS, Draw, decode

        entry = DECODE_LOOPS[loop]  # its own options at their defaults; compile_step: a loop that compiles
        built = entry(compile_step=True) if compile_step else entry()
        draw = Draw(tokens, {0}, 0, temperature=1.0, min_new_tokens=tokens, row_seeds=self.seeds)
        # the compiled step keeps its copies, as TransformersBackend does: dequantized_weights(model, persistent=compiled)
        with dequantized_weights(self.policy, persistent=compile_step) if dense else contextlib.nullcontext():
            return decode(self.policy, self.ids, self.mask, self.group, draw, built)


def sync(torch, device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(model: Model, tokens: int, how: tuple) -> dict:
    import torch

    row = {k: None for k in VARIANT}
    dense, loop, compile_step = how
    if compile_step and model.device != "cuda":
        row["error"] = "a CUDA graph needs CUDA"
        return row
    if compile_step:  # the first call compiles and captures
        sync(torch, model.device)
        t0 = time.perf_counter()
        model.sample(tokens, dense, loop, compile_step)
        sync(torch, model.device)
        row["first_call_s"] = round(time.perf_counter() - t0, 3)
    if model.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    sync(torch, model.device)
    t0 = time.perf_counter()
    out = model.sample(tokens, dense, loop, compile_step)
    sync(torch, model.device)
    seconds = time.perf_counter() - t0
    row.update(tokens=out.shape[1], seconds=round(seconds, 3), ms_per_token=round(1000 * seconds / out.shape[1], 3),
               persistent=bool(dense and compile_step))
    if model.device == "cuda":
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    row["_out"] = out
    return row


def profiled(model: Model, name: str, tokens: int) -> dict:
    """``torch.profiler``'s split of one call of ``tokens`` tokens of variant ``name``."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    dense, loop, compile_step = VARIANTS[name]
    cuda = model.device == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    model.sample(tokens, dense, loop, compile_step)  # warm (and compiled, for the graph)
    sync(torch, model.device)
    with profile(activities=activities) as prof:
        model.sample(tokens, dense, loop, compile_step)
        sync(torch, model.device)
    events = prof.key_averages()
    cpu_us = sum(e.self_cpu_time_total for e in events)
    dev_us = sum(getattr(e, "self_device_time_total", 0) for e in events) if cuda else None
    launches = sum(e.count for e in events if getattr(e, "device_type", None) == torch.autograd.DeviceType.CUDA) \
        if cuda else None
    key = "self_device_time_total" if cuda else "self_cpu_time_total"
    top = sorted(events, key=lambda e: getattr(e, key, 0), reverse=True)[:5]
    return {"variant": name, "tokens": tokens, "cpu_ms_per_token": round(cpu_us / 1000 / tokens, 3),
            "cuda_ms_per_token": None if dev_us is None else round(dev_us / 1000 / tokens, 3),
            "launches_per_token": None if launches is None else round(launches / tokens, 1),
            "top": [f"{e.key}: {getattr(e, key, 0) / 1000:.1f} ms, {e.count} calls" for e in top]}


def same_share(a, b) -> float:
    n = min(a.shape[1], b.shape[1])
    return round(float((a[:, :n].cpu() == b[:, :n].cpu()).all(1).float().mean()), 4)


def measure(args) -> dict:
    out = {k: None for k in SCHEMA}
    out["variants"] = {name: {k: None for k in VARIANT} for name in VARIANTS}
    for key in ("profile_before", "profile_after"):  # without --profile: present, every figure null
        out[key] = {k: [] if v.startswith("list") else None for k, v in PROFILE.items()}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        model = Model(args, Path(tmp))
        out.update(device=model.device, model=str(model.source), dtype=str(model.dtype).removeprefix("torch."),
                   rows=model.rows, group=model.group, prompt_tokens=args.prompt_tokens)
        names = args.variants.split(",")
        reference, ref_name = None, "dense-dynamic" if "dense-dynamic" in names else names[0]
        for name in names:
            try:
                row = timed(model, variant_tokens(args, name), VARIANTS[name])
            except Exception as err:  # one variant failing (a compile on a new card) leaves the others
                row = {k: None for k in VARIANT} | (oom.oom_figure(err) or {}) | {"error": f"{type(err).__name__}: {err}"[:300]}
                failures.append(oom.describe(name, row, None) if row["oom"] else f"{name}: {row['error']}")
            got = row.pop("_out", None)
            if name == ref_name:
                reference = got
            elif got is not None and reference is not None:
                row["same_tokens"] = same_share(got, reference)
            out["variants"][name] = row
            print(f"  {name:<20} " + ", ".join(f"{k} {v}" for k, v in row.items() if v is not None), flush=True)
            save()
        ran = [n for n in names if out["variants"][n]["ms_per_token"] is not None]
        before = out["variants"]["nf4-dynamic"]["ms_per_token"]
        if before and ran:
            out["speedup"] = round(before / min(out["variants"][n]["ms_per_token"] for n in ran), 2)
        if args.profile and ran:
            out["profile_before"] = profiled(model, ran[0], args.profile_tokens)
            save()
            fastest = min(ran, key=lambda n: out["variants"][n]["ms_per_token"])
            out["profile_after"] = profiled(model, fastest, args.profile_tokens)
    save()
    return out, failures


def variant_tokens(args, name: str) -> int:
    """Tokens per completion of variant ``name``."""
    if name == "nf4-dynamic":
        return args.before_tokens
    return args.new_tokens if VARIANTS[name][2] else (args.uncompiled_tokens or args.new_tokens)


def main(argv=None) -> int:
    """Exit 0 when every variant asked for ran (a graph on a CPU is not asked of it: its error is
    recorded, not a failure); 1 otherwise, the last line naming each failure."""
    args = parse_args(argv)
    print(f"{args.params}: {args.rows} rows x {args.new_tokens} new tokens after {args.prompt_tokens} prompt tokens "
          f"(nf4-dynamic: {args.before_tokens}; the other uncompiled: {args.uncompiled_tokens or args.new_tokens})",
          flush=True)
    out, failures = measure(args)
    for key in ("speedup", "profile_before", "profile_after"):
        print(f"  {key:<20} {out[key]}")
    if failures:
        print(f"decode_speed: FAILED: {'; '.join(failures)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
