"""The two ways to get the trained policy into a vLLM engine, measured: merged dense weights vs a
LoRA adapter loaded through vLLM's LoRA support.

    python bench/weight_sync.py [--model models/base] [--prompts 32] [--group 8] [--new-tokens 64] [--rounds 3]

Both engines start from the same dense export of the NF4 base (``grpo.policy.export_dense``), and
the policy's LoRA adapter (r16 / alpha 32 on q/k/v/o, B drawn at random so that it matters) changes
every round, as an optimizer step would. Per round and way:

* ``merged``: ``VLLMPolicyBackend.sync`` (``W + s B A`` written into the engine's fused layers).
* ``lora``: the adapter saved with peft, then a new ``LoRARequest`` for it (vLLM loads the files).

Then each engine samples ``prompts x group`` completions (temperature 1, at most ``new-tokens``)
and greedily decodes the prompts; the greedy texts are compared with the policy's own decode loop
on NF4 + LoRA (exactness). Prints the sync time, the sampling speed and the exact-match count of
each way; ``--json`` writes them.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(args, way: str) -> dict:
    """One way, in this process: ``merged`` or ``lora``."""
    import torch

    from grpo.base_model import load_tokenizer
    from grpo.config import DEFAULT_SYSTEM_PROMPT, LoraConfig, ModelConfig, VLLMEngineConfig
    from grpo.data import build_prompt
    from grpo.jsonio import read_jsonl
    from grpo.policy import export_dense, load_policy
    from grpo.rollout import make_backend

    torch.manual_seed(0)
    model_cfg = ModelConfig(path=args.model)
    model = load_policy(model_cfg, LoraConfig(rank=16, alpha=32))
    tok = load_tokenizer(args.model)
    prompts = [build_prompt(tok, r["question"], DEFAULT_SYSTEM_PROMPT) for r in read_jsonl(args.data)[: args.prompts]]
    own = make_backend("transformers", tok, policy=model)  # NF4 + LoRA, dequantised once per call (exact, tested)
    sampling = dict(max_new_tokens=args.new_tokens, temperature=1.0)
    greedy = dict(max_new_tokens=args.new_tokens, temperature=0.0)
    out: dict = {"way": way, "sync_s": [], "tok_s": [], "exact": [], "prompts": len(prompts)}
    with tempfile.TemporaryDirectory() as tmp:
        engine_dir = Path(tmp) / "engine"
        export_dense(model_cfg, None, engine_dir)
        engine = VLLMEngineConfig(gpu_memory_utilization=args.gpu_memory_utilization, max_model_len=1024)
        t0 = time.perf_counter()
        if way == "merged":  # the engine starts from the export above
            backend = make_backend("vllm", tok, policy=model, engine_dir=engine_dir, engine=engine)
        else:
            backend = make_backend("vllm", tok, model_dir=engine_dir, engine=engine, progress=False, enable_lora=True,
                                   max_lora_rank=16, max_loras=1)
            from vllm.lora.request import LoRARequest
        out["engine_start_s"] = time.perf_counter() - t0
        request = None
        original = backend.llm.generate
        backend.llm.generate = lambda *a, **k: original(*a, **k, lora_request=request) if request else original(*a, **k)
        for rnd in range(args.rounds):
            gen = torch.Generator().manual_seed(rnd)
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.data = torch.randn(p.shape, generator=gen) * 0.02
            reference = own.generate(prompts, 1, **greedy).texts
            t0 = time.perf_counter()
            if way == "merged":
                backend.sync(model)
            else:
                adapter = Path(tmp) / f"adapter_{rnd}"
                model.save_pretrained(adapter)
                if request is not None:
                    backend.llm.llm_engine.remove_lora(request.lora_int_id)
                request = LoRARequest(f"policy-{rnd}", rnd + 1, str(adapter))
                backend.llm.llm_engine.add_lora(request)
            out["sync_s"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            roll = backend.generate(prompts, args.group, **sampling)
            out["tok_s"].append(float(roll.completion_mask.sum()) / (time.perf_counter() - t0))
            texts = backend.generate(prompts, 1, **greedy).texts
            out["exact"].append(sum(a == b for a, b in zip(texts, reference)))
        backend.close()
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
    ap.add_argument("--way", choices=["merged", "lora"], help=argparse.SUPPRESS)  # one way, in this process
    ap.add_argument("--json")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    if args.way:
        print(json.dumps(run(args, args.way)))
        return
    results = {}
    for way in ("merged", "lora"):  # each engine in a fresh process
        proc = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--way", way], capture_output=True, text=True)
        if proc.returncode:
            print(f"{way}: failed:\n{proc.stderr[-3000:]}", file=sys.stderr)
            continue
        results[way] = json.loads(proc.stdout.strip().splitlines()[-1])
    print(f"{args.prompts} prompts x G={args.group}, <= {args.new_tokens} new tokens, {args.rounds} rounds")
    print(f"{'way':<8} {'engine start s':>14} {'sync s (median)':>16} {'sampling tok/s (median)':>24}  greedy = policy")
    for way, r in results.items():
        print(f"{way:<8} {r['engine_start_s']:14.1f} {statistics.median(r['sync_s']):16.3f} "
              f"{statistics.median(r['tok_s']):24.1f}  {r['exact']} of {r['prompts']} per round")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
