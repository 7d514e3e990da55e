"""The train engine's forms, measured: merged dense weights against the trainer's own 4-bit
weights with the policy's LoRA adapter.

    python bench/weight_sync.py [--model models/base] [--prompts 32] [--group 8] [--new-tokens 64] [--rounds 3]
                                [--ways dense nf4] [--dtype auto] [--json FILE]

Each way is the engine ``grpo.rollout.engine.policy_engine.policy_rollouts`` builds for the train stage (``train.rollouts.engine_weights``), in a
fresh process, started from the NF4 base as training loads it; the policy's LoRA adapter (r16 /
alpha 32 on q/k/v/o, B drawn at random so that it matters) changes every round, as an optimizer
step would. Per round and way: ``sync`` (timed), then ``prompts x group`` completions (temperature 1,
at most ``new-tokens``; timed), the mean |engine log-prob - policy log-prob| over their tokens
(the policy teacher-forced on them: the gap the importance-sampling correction sees), and a greedy
decode of the prompts compared with the policy's own NF4 + LoRA decode (exactness).

* ``dense``: ``DenseSync`` (``W + s B A`` written into the engine's fused layers).
* ``nf4``: the engine computes with the policy's own ``Linear4bit`` modules (``grpo.rollout.engine.nf4_form``);
  ``AdapterSync`` (the adapter saved, loaded under a new id).

Prints engine start, median sync time, median sampling speed, the log-prob gap (mean and largest
round), the exact-match count of each way and the process's peak resident set (``ru_maxrss``:
policy, engine and all); ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
WAYS = ("dense", "nf4")
"""The ``form`` of ``policy_rollouts``."""


def run(args, way: str) -> dict:
    """One way, in this process."""
    import torch

    from grpo.config.sections.engine import VLLMEngineConfig
    from grpo.config.sections.lora import LoraConfig
    from grpo.config.sections.model import ModelConfig
    from grpo.config.sections.shared import DEFAULT_SYSTEM_PROMPT
    from grpo.core.jsonio import read_jsonl
    from grpo.data.sources import build_prompt
    from grpo.model.base_model import load_tokenizer
    from grpo.model.lora_policy import load_policy
    from grpo.rollout.engine.policy_engine import PolicyEngineSpec, policy_rollouts
    from grpo.rollout.rollout_backends import TransformersBackend

    torch.manual_seed(0)
    model_cfg = ModelConfig(path=args.model, dtype=args.dtype)
    model = load_policy(model_cfg, LoraConfig(rank=16, alpha=32))
    tok = load_tokenizer(args.model)
    prompts = [build_prompt(tok, r["question"], DEFAULT_SYSTEM_PROMPT) for r in read_jsonl(args.data)[: args.prompts]]
    own = policy_rollouts("transformers", tok, model)  # NF4 + LoRA, dequantised once per call (exact, tested)
    scorer = TransformersBackend(model, tok)  # teacher-forced log-probs of the policy
    sampling = dict(max_new_tokens=args.new_tokens, temperature=1.0)
    greedy = dict(max_new_tokens=args.new_tokens, temperature=0.0)
    out: dict = {"way": way, "sync_s": [], "tok_s": [], "logp_gap_mean": [], "exact": [], "prompts": len(prompts)}
    with tempfile.TemporaryDirectory() as tmp:
        engine = VLLMEngineConfig(gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=1024)
        t0 = time.perf_counter()  # the engine's folder written + engine start
        spec = PolicyEngineSpec(Path(tmp) / "engine", engine, model_cfg, form=way, dtype=args.dtype)
        backend = policy_rollouts("vllm", tok, model, engine=spec)
        out["engine_start_s"] = time.perf_counter() - t0
        for rnd in range(args.rounds):
            gen = torch.Generator().manual_seed(rnd)
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.data = torch.randn(p.shape, generator=gen) * 0.02
            reference = own.generate(prompts, 1, **greedy).texts
            t0 = time.perf_counter()
            backend.sync(model)
            out["sync_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            roll = backend.generate(prompts, args.group, **sampling)
            out["tok_s"].append(float(roll.completion_mask.sum()) / (time.perf_counter() - t0))
            policy_logp = scorer._teacher_forced_logprobs(roll.prompt_ids, roll.prompt_mask, roll.completion_ids,
                                                          roll.completion_mask, args.group)
            mask = roll.completion_mask.bool()
            out["logp_gap_mean"].append(float((roll.logprobs - policy_logp).abs()[mask].mean()))
            texts = backend.generate(prompts, 1, **greedy).texts
            out["exact"].append(sum(a == b for a, b in zip(texts, reference)))
        backend.close()
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="models/base")
    ap.add_argument("--data", default="data/raw/train.jsonl")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--ways", nargs="+", choices=WAYS, default=list(WAYS))
    ap.add_argument("--dtype", default="auto", help="compute dtype of the policy and the engine (model.dtype)")
    ap.add_argument("--way", choices=WAYS, help=argparse.SUPPRESS)  # one way, in this process
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    if args.way:
        print(json.dumps(run(args, args.way)))
        return
    results = {}
    for way in args.ways:  # each engine in a fresh process
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--way", way], capture_output=True, text=True)
        if proc.returncode:
            print(f"{way}: failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        results[way] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{args.prompts} prompts x G={args.group}, <= {args.new_tokens} new tokens, {args.rounds} rounds")
    print(f"{'way':<6} {'folder+start s':>14} {'sync s (median)':>16} {'sampling tok/s (median)':>24} "
          f"{'|logp gap| mean':>16} {'worst round':>12} {'peak RSS MB':>12}  greedy = policy")
    for way, r in results.items():
        print(f"{way:<6} {r['engine_start_s']:14.1f} {statistics.median(r['sync_s']):16.3f} "
              f"{statistics.median(r['tok_s']):24.1f} {statistics.mean(r['logp_gap_mean']):16.6f} "
              f"{max(r['logp_gap_mean']):12.6f} {r['peak_rss_mb']:12.0f}  {r['exact']} of {r['prompts']} per round")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
