"""SENT's and the evaluations' decode loop (no vLLM) at their call sizes on a real card.

Where vLLM is missing, ``grpo.rollout.engine.sampler.saved_model_sampler`` samples a saved model (SENT: the
base; the evaluations: the policy exported dense) with ``TransformersBackend``, log-probs included.
This draws the params' architecture with random weights (``bench/device_update.py``'s ``setup``),
saves it, and in a process per stage (as the pipeline runs them) opens it as that stage does and
makes its largest call once: SENT's ``sent.batch_prompts`` prompts x ``sent.num_samples`` answers of ``sent.max_new_tokens`` tokens,
the evaluation's ``evaluate.batch_prompts`` prompts x 1 of ``evaluate.max_new_tokens`` (every
completion full length: the worst case; prompts of ``--prompt-tokens``). Per call: seconds,
milliseconds per token, CUDA's peak allocated with the allocator capped at ``--memory-cap-gib``
(seed 003's card), the prompts one decode call took (``TransformersBackend.prompts_per_call``: the
split under the cap) and the prediction it is held against: the dense weights plus
``grpo.rollout.decode_memory.sampler_call_bytes`` for one such call, and what was allocated before it (the
weights). The decode loop is the one each stage plans (``grpo.rollout.sampling.plan_decode`` on the params'
``decode`` section, the stage's token steps at the data's sizes: compiled on CUDA).

A call that fails is recorded (``error``; an out-of-memory error with its figures, ``bench/oom.py``)
and the next call still runs; the script then exits 1, its last line naming each failure, so the
device check's phase fails with the figure. Exit 0 when every call ran.

    python bench/sampler_calls.py [--params presets/seed003.yaml] [--new-tokens N] [--json FILE]
    python bench/sampler_calls.py --dry-run    # on a CPU: the toy model, small calls (checks the script)
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import device_update  # noqa: E402  (the params' architecture, drawn at random, as the update check does)
import oom  # noqa: E402

CALL = {
    "prompts": "int?: prompts in the call", "samples": "int?: completions per prompt",
    "new_tokens": "int?: tokens per completion", "seconds": "number?: the call's wall seconds, log-probs included",
    "ms_per_token": "number?: seconds / new_tokens, in ms", "peak_allocated_gib": "number?: CUDA's max_memory_allocated",
    "predicted_gib": "number?: dense weights + sampler_call_bytes for one call of prompts_per_call prompts "
                     "(on a compiled step: padded to it, its kept buffers counted; grpo.rollout.decode_memory.split_call)",
    "prompts_per_call": "int?: the prompts one decode call took (the split under the cap)",
    "allocated_before_gib": "number?: CUDA's memory_allocated before the call (the weights, and what earlier calls kept)",
    "loop": "str?: the decode loop the call ran (grpo.rollout.sampling.plan_decode's why)",
    "error": "str?: why the call did not run, one line",
    **oom.SCHEMA,
}
SCHEMA = {
    "device": "str?: cuda, or cpu on --dry-run", "model": "str?: the architecture the weights were drawn for",
    "dtype": "str?: the compute dtype", "prompt_tokens": "int?: prompt length",
    "weights_gib": "number?: the dense model's parameters in the compute dtype",
    "memory_cap_gib": "number?: the allocator's per-process cap (seed 003's card), or null",
    "sent": CALL, "evaluate": CALL,
}


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="presets/seed003.yaml", help="params file (a preset over params.yaml)")
    ap.add_argument("--prompt-tokens", type=int, default=128, help="prompt length")
    ap.add_argument("--dry-run", action="store_true", help="CPU, the toy model, small calls: checks the script")
    ap.add_argument("--json", help="write the figures here (after each call)")
    ap.add_argument("--memory-cap-gib", type=float, default=7.6,
                    help="cap the CUDA allocator at this many GiB (seed 003's card; 0: no cap)")
    ap.add_argument("--new-tokens", type=int, help="every call's tokens per completion instead of the stage's")
    ap.add_argument("--call", choices=("sent", "evaluate"), help=argparse.SUPPRESS)  # one call, in a child process
    ap.add_argument("--base", help=argparse.SUPPRESS)  # the saved random base the children open
    args = ap.parse_args(argv)
    args.entropy_rule = args.top_quantile = None  # device_update.setup's other knobs
    if args.dry_run:
        args.prompt_tokens = 12
    return args


def calls(p, dry_run: bool, new_tokens: int | None = None) -> dict[str, tuple[int, int, int]]:
    """Stage -> (prompts, completions per prompt, new tokens) of its largest call (``new_tokens``:
    every call's tokens instead)."""
    sizes = ({"sent": (2, 3, 6), "evaluate": (3, 1, 6)} if dry_run else
             {"sent": (p.sent.batch_prompts, p.sent.num_samples, p.sent.max_new_tokens),
              "evaluate": (p.evaluate.batch_prompts, 1, p.evaluate.max_new_tokens)})
    return {k: (n, g, new_tokens or c) for k, (n, g, c) in sizes.items()}


def stage_prompts(p, stage: str) -> int:
    """The prompts the stage samples in the pipeline (SENT: the train split; the evaluation: the test
    split), from which its decode plan counts its token steps."""
    return p.data.train_size if stage == "sent" else p.data.test_size


def one_call(sampler, model, prompts: list[str], samples: int, new_tokens: int, weights: int, cuda: bool,
             row: dict) -> dict:
    """The call made once, its figures written into ``row`` (a ``CALL``) as they come, so a call
    that raises leaves its prediction and split there."""
    import torch

    from grpo.rollout.decode_memory import CallSize, allocator_budget, model_dims, sampler_call_bytes, split_call
    from grpo.rollout.sampling import compiled_steps

    if cuda:
        row["allocated_before_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
    rows = len(prompts) * samples
    prompt_len = max(len(t) for t in sampler.tokenizer(prompts, add_special_tokens=False)["input_ids"])
    device = next(model.parameters()).device
    per_call = sampler.prompts_per_call(len(prompts), samples, prompt_len, new_tokens, device)
    call = CallSize(len(prompts), samples, prompt_len, new_tokens)  # a compiled call padded to its step (as the sampler splits)
    compiled = split_call(model_dims(model), call, allocator_budget(device), sampler.LOGPROB_ROWS,
                          sampler.decode_plan(device).loop, compiled_steps(model))[1]
    work = sampler_call_bytes(model, per_call, samples, prompt_len, new_tokens, sampler.LOGPROB_ROWS, compiled)
    row.update(prompts_per_call=per_call, predicted_gib=round((weights + work) / 2**30, 3))
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    sampler.min_new_tokens = new_tokens  # every completion full length
    roll = sampler.generate(prompts, samples, max_new_tokens=new_tokens, temperature=1.0,
                            seeds=list(range(rows)))
    if cuda:
        torch.cuda.synchronize()
        row["peak_allocated_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    seconds = time.perf_counter() - t0
    row.update(seconds=round(seconds, 3), ms_per_token=round(1000 * seconds / roll.completion_ids.shape[1], 3),
               loop=sampler.plan.why if sampler.plan else None)
    return row


def failed_call(err: Exception, partial: dict | None) -> dict:
    """The ``CALL`` of a call that raised ``err``: its figures so far, the error, and an
    out-of-memory error's figures (read before anything is freed)."""
    figure = oom.oom_figure(err) or {}
    return {k: None for k in CALL} | (partial or {}) | figure | {"error": f"{type(err).__name__}: {err}"[:300]}


def cap_allocator(args, device: str) -> None:
    import torch

    if device == "cuda" and args.memory_cap_gib:
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * 2**30 / torch.cuda.mem_get_info()[1])


def stage_call(args) -> dict:
    """``--call STAGE`` (a child process, as the stage is its own): the saved model at ``--base``
    opened as the stage opens it, and its largest call made once: the ``CALL`` record."""

    from grpo.core.device import compute_dtype
    from grpo.model.base_model import load_tokenizer
    from grpo.rollout.engine.sampler import SavedModelRun, saved_model_sampler
    from grpo.rollout.rollout_backends import DecodeChoice, planned_tokens

    p, _config, _source, device = device_update.setup(args)
    cap_allocator(args, device)
    dtype = compute_dtype(p.model.dtype, device)
    n, samples, new_tokens = calls(p, args.dry_run, args.new_tokens)[args.call]
    cfg = p.sent if args.call == "sent" else p.evaluate
    tok = load_tokenizer(args.base)
    run = SavedModelRun(dtype=str(dtype).removeprefix("torch."))
    sampler = saved_model_sampler("transformers", tok, args.base, run=run,
                                  decode=DecodeChoice(p.decode, planned_tokens(stage_prompts(p, args.call), cfg)))
    weights = sum(t.numel() * t.element_size() for t in sampler.model.parameters())
    words = tok.decode(list(range(100, 100 + args.prompt_tokens)))
    prompts = [f"{i} {words}" for i in range(n)]
    row = {k: None for k in CALL} | {"prompts": n, "samples": samples, "new_tokens": new_tokens}
    try:
        return one_call(sampler, sampler.model, prompts, samples, new_tokens, weights, device == "cuda", row)
    except Exception as err:  # recorded with its figures; the parent fails the run
        return failed_call(err, row)


def child_call(args, stage: str, base: Path, tmp: Path) -> dict:
    """``stage``'s call in a child process (``--call``): its ``CALL`` record, or one saying how the
    child ended when it wrote none."""
    result = tmp / f"{stage}.json"
    argv = [sys.executable, __file__, "--call", stage, "--base", str(base), "--json", str(result), "--params",
            args.params, "--prompt-tokens", str(args.prompt_tokens), "--memory-cap-gib", str(args.memory_cap_gib)]
    argv += ["--dry-run"] * args.dry_run + (["--new-tokens", str(args.new_tokens)] if args.new_tokens else [])
    rc = subprocess.run(argv).returncode
    if result.exists():
        return json.loads(result.read_text())
    return {k: None for k in CALL} | {"error": f"the call's process ended with exit {rc} and no record"}


def measure(args) -> tuple[dict, list[str]]:
    """The random base drawn and saved once, then each stage's call in its own process: the
    record (``SCHEMA``) and a line per failed call."""
    import torch

    from grpo.core.device import compute_dtype
    from grpo.tools.synthetic import random_model_dir

    p, config, source, device = device_update.setup(args)
    dtype = compute_dtype(p.model.dtype, device)
    out = {k: None for k in SCHEMA} | {"device": device, "model": str(source), "prompt_tokens": args.prompt_tokens,
                                       "dtype": str(dtype).removeprefix("torch."),
                                       "memory_cap_gib": args.memory_cap_gib if device == "cuda" else None}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

    failures = []
    with tempfile.TemporaryDirectory() as tmp:
        base = random_model_dir(Path(tmp) / "base", config, dtype=dtype, device=device)
        if device == "cuda":  # the calls' processes get the card
            torch.cuda.empty_cache()
        out["weights_gib"] = round(sum(f.stat().st_size for f in base.glob("*.safetensors")) / 2**30, 3)
        for stage in calls(p, args.dry_run):
            out[stage] = row = child_call(args, stage, base, Path(tmp))
            if row["error"]:
                failures.append(failure(stage, row, out["memory_cap_gib"]))
            print(f"  {stage:<9} " + ", ".join(f"{k} {v}" for k, v in row.items() if v is not None), flush=True)
            save()
    return out, failures


def failure(stage: str, row: dict, cap_gib: float | None) -> str:
    """One line naming a failed call: an out-of-memory error with its figures (``oom.describe``)."""
    return oom.describe(f"{stage}'s call", row, cap_gib) if row["oom"] else f"{stage}'s call: {row['error']}"


def main(argv=None) -> int:
    """Exit 0 when every call ran; 1 (the last line naming each failure and its figures) otherwise."""
    args = parse_args(argv)
    if args.call:
        row = stage_call(args)
        Path(args.json).write_text(json.dumps(row, indent=1) + "\n")
        if row["error"]:
            print(f"sampler_calls: FAILED: {failure(args.call, row, args.memory_cap_gib if row['allocated_gib'] is not None else None)}",
                  flush=True)
        return 1 if row["error"] else 0
    _, failures = measure(args)
    if failures:
        print(f"sampler_calls: FAILED: {'; '.join(failures)}", flush=True)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
