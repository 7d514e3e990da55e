"""SENT's and the evaluations' decode loop (no vLLM) at their call sizes on a real card.

Where vLLM is missing, ``grpo.engine.sampler.saved_model_sampler`` samples a saved model (SENT: the
base; the evaluations: the policy exported dense) with ``TransformersBackend``, log-probs included.
This draws the params' architecture with random weights (``bench/device_update.py``'s ``setup``),
saves it, opens it as those stages do, and makes each stage's largest call once: SENT's
``sent.batch_prompts`` prompts x ``sent.num_samples`` answers of ``sent.max_new_tokens`` tokens,
the evaluation's ``evaluate.batch_prompts`` prompts x 1 of ``evaluate.max_new_tokens`` (every
completion full length: the worst case; prompts of ``--prompt-tokens``). Per call: seconds,
milliseconds per token, CUDA's peak allocated with the allocator capped at ``--memory-cap-gib``
(seed 003's card), the prompts one decode call took (``TransformersBackend.prompts_per_call``: the
split under the cap) and the prediction it is held against: the dense weights plus
``grpo.decode_memory.sampler_call_bytes`` for one such call.

    python bench/sampler_calls.py [--params presets/seed003.yaml] [--json FILE]
    python bench/sampler_calls.py --dry-run    # on a CPU: the toy model, small calls (checks the script)
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

CALL = {
    "prompts": "int?: prompts in the call", "samples": "int?: completions per prompt",
    "new_tokens": "int?: tokens per completion", "seconds": "number?: the call's wall seconds, log-probs included",
    "ms_per_token": "number?: seconds / new_tokens, in ms", "peak_allocated_gib": "number?: CUDA's max_memory_allocated",
    "predicted_gib": "number?: dense weights + sampler_call_bytes for one call of prompts_per_call prompts",
    "prompts_per_call": "int?: the prompts one decode call took (the split under the cap)",
    "error": "str?: why the call did not run, one line",
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
    args = ap.parse_args(argv)
    args.entropy_rule = None  # device_update.setup's other knobs
    if args.dry_run:
        args.prompt_tokens = 12
    return args


def calls(p, dry_run: bool) -> dict[str, tuple[int, int, int]]:
    """Stage -> (prompts, completions per prompt, new tokens) of its largest call."""
    if dry_run:
        return {"sent": (2, 3, 6), "evaluate": (3, 1, 6)}
    return {"sent": (p.sent.batch_prompts, p.sent.num_samples, p.sent.max_new_tokens),
            "evaluate": (p.evaluate.batch_prompts, 1, p.evaluate.max_new_tokens)}


def one_call(sampler, model, prompts: list[str], samples: int, new_tokens: int, weights: int, cuda: bool) -> dict:
    import torch

    from grpo.decode_memory import sampler_call_bytes

    row = {k: None for k in CALL} | {"prompts": len(prompts), "samples": samples, "new_tokens": new_tokens}
    rows = len(prompts) * samples
    prompt_len = max(len(t) for t in sampler.tokenizer(prompts, add_special_tokens=False)["input_ids"])
    device = next(model.parameters()).device
    per_call = sampler.prompts_per_call(len(prompts), samples, prompt_len, new_tokens, device)
    work = sampler_call_bytes(model, per_call, samples, prompt_len, new_tokens, sampler.LOGPROB_ROWS)
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
    row.update(seconds=round(seconds, 3), ms_per_token=round(1000 * seconds / roll.completion_ids.shape[1], 3))
    return row


def measure(args) -> dict:
    import torch

    from grpo.base_model import load_tokenizer
    from grpo.device import compute_dtype
    from grpo.engine.sampler import saved_model_sampler
    from grpo.synthetic import random_model_dir

    p, config, source, device = device_update.setup(args)
    if device == "cuda" and args.memory_cap_gib:
        torch.cuda.set_per_process_memory_fraction(args.memory_cap_gib * 2**30 / torch.cuda.mem_get_info()[1])
    dtype = compute_dtype(p.model.dtype, device)
    out = {k: None for k in SCHEMA} | {"device": device, "model": str(source), "prompt_tokens": args.prompt_tokens,
                                       "dtype": str(dtype).removeprefix("torch."),
                                       "memory_cap_gib": args.memory_cap_gib if device == "cuda" else None}

    def save() -> None:
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1) + "\n")

    with tempfile.TemporaryDirectory() as tmp:
        base = random_model_dir(Path(tmp) / "base", config, dtype=dtype, device=device)
        tok = load_tokenizer(base)
        sampler = saved_model_sampler("transformers", tok, base, dtype=str(dtype).removeprefix("torch."))
        model = sampler.model
        weights = sum(t.numel() * t.element_size() for t in model.parameters())
        out["weights_gib"] = round(weights / 2**30, 3)
        words = tok.decode(list(range(100, 100 + args.prompt_tokens)))
        for stage, (n, samples, new_tokens) in calls(p, args.dry_run).items():
            prompts = [f"{i} {words}" for i in range(n)]
            try:
                out[stage] = one_call(sampler, model, prompts, samples, new_tokens, weights, device == "cuda")
            except Exception as err:  # the evaluation's call still runs when SENT's does not fit
                out[stage] = {k: None for k in CALL} | {"error": f"{type(err).__name__}: {err}"[:300]}
            print(f"  {stage:<9} " + ", ".join(f"{k} {v}" for k, v in out[stage].items() if v is not None), flush=True)
            save()
            if device == "cuda":
                torch.cuda.empty_cache()
    return out


def main(argv=None) -> dict:
    args = parse_args(argv)
    return measure(args)


if __name__ == "__main__":
    main()
