"""The memory estimate of ``grpo check`` (``grpo.memory``) against real objects, on the CPU.

A step's peak resident memory on the CPU is the wrong thing to compare with (the allocator keeps
freed memory, libraries take their share), so this checks the parts that can be counted exactly:

* LoRA parameters: ``grpo.memory.lora_params`` against the peft model's trainable parameters;
* weights: ``grpo.memory.weight_bytes`` against the storage of the real bitsandbytes NF4 model
  (every 4-bit weight with its quantisation state, every other parameter once);
* KV cache: ``grpo.memory.kv_cache_bytes`` against the tensors of the ``DynamicCache`` that
  ``generate`` returns after a short fixed-length generation;
* activations: ``grpo.memory.activation_bytes`` against the tensors autograd saves in the training
  forward (``grpo.logprobs.completion_hidden``, counted once per storage with
  ``torch.autograd.graph.saved_tensors_hooks``), fp32 and bf16, LoRA dropout 0 and 0.05, shared
  prompts and gradient checkpointing.

    python bench/memory_estimate.py                      # tiny Llama and a SmolLM2-135M-shaped random model
    python bench/memory_estimate.py --model models/base  # also a real model directory

Each line: the part, the estimate, the real count, their ratio.
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def real_lora_params(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def real_weight_bytes(model) -> int:
    """Bytes of the model's parameters as stored: 4-bit weights with their quantisation state,
    every other parameter once (tied weights share a storage); LoRA parameters excluded."""
    import bitsandbytes as bnb

    seen: dict[int, int] = {}

    def add(t):
        if t is not None:
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            qs = module.weight.quant_state
            for t in (module.weight.data, qs.absmax, qs.code, qs.offset):
                add(t)
            if qs.state2 is not None:
                add(qs.state2.absmax)
                add(qs.state2.code)
    for name, p in model.named_parameters():
        if "lora_" not in name and not isinstance(p, bnb.nn.Params4bit):
            add(p)
    return sum(seen.values())


def real_kv_bytes(model, ids, mask, new_tokens: int) -> int:
    """Bytes of the ``DynamicCache`` after ``new_tokens`` generated tokens (EOS suppressed)."""
    import torch

    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, return_dict_in_generate=True, pad_token_id=0)
    cache = out.past_key_values
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values))


def batch(vocab: int, prompts: int, group: int, prompt_len: int, completion_len: int, seed: int = 0):
    """(ids, mask) of ``prompts * group`` rows: each group shares a left-padded prompt (the first
    prompt has 3 padding tokens), completions right-padded (every other row ends 5 tokens early)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    n = prompts * group
    prompt = torch.randint(10, vocab, (prompts, prompt_len), generator=g).repeat_interleave(group, 0)
    pmask = torch.ones_like(prompt)
    pmask[:group, :3] = 0
    comp = torch.randint(10, vocab, (n, completion_len), generator=g)
    cmask = torch.ones_like(comp)
    if completion_len > 5:
        cmask[::2, completion_len - 5:] = 0
    return torch.cat([prompt, comp], 1), torch.cat([pmask, cmask], 1)


def saved_activation_bytes(model, ids, mask, prompt_len: int, group: int, packed: bool = False) -> int:
    """Bytes autograd saves in one training forward (each storage once, parameters excluded); with
    ``packed``, each group as one sequence."""
    import torch

    from grpo.logprobs import completion_hidden
    from grpo.lora_policy import lm_parts

    body, _ = lm_parts(model)
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t):
        s = t.untyped_storage()
        if s.data_ptr() not in params:
            seen[s.data_ptr()] = s.nbytes()
        return t

    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        completion_hidden(body, ids, mask, prompt_len, group, packed)
    return sum(seen.values())


def check_model(model_dir: Path, label: str, *, heavy: bool = True) -> list[tuple[str, int, int]]:
    """``(part, estimate, real)`` rows for one model directory."""
    import torch
    from transformers import AutoConfig

    from grpo import memory
    from grpo.lora_policy import load_policy, load_training_base
    from grpo.sections.lora import LoraConfig
    from grpo.sections.model import ModelConfig

    shapes = memory.model_shapes(AutoConfig.from_pretrained(model_dir), str(model_dir))
    rows = []
    lora = LoraConfig()
    base = load_training_base(ModelConfig(path=str(model_dir)), "cpu")
    rows.append((f"{label}: weights, NF4 + fp32", memory.weight_bytes(shapes, "nf4", 4), real_weight_bytes(base)))
    ids, mask = batch(shapes.vocab, 2, 2, 12, 0)  # left-padded prompts only
    positions = ids.shape[1] + 6 - 1  # the last generated token is never fed back
    rows.append((f"{label}: KV cache, 4 rows x {positions} positions, fp32",
                 memory.kv_cache_bytes(shapes, 4, positions, 4), real_kv_bytes(base, ids, mask, 6)))
    del base
    cases = [("fp32", 0.0, False, True), ("fp32", 0.0, False, False), ("fp32", 0.0, True, False)]
    if heavy:
        cases += [("bfloat16", 0.05, False, True), ("bfloat16", 0.0, False, False), ("bfloat16", 0.05, True, False)]
    prompts, group, p, c = 2, 4, 16, 24
    ids, mask = batch(shapes.vocab, prompts, group, p, c)
    for dtype, dropout, ckpt, shared in cases:
        torch.manual_seed(0)
        lora = LoraConfig(dropout=dropout)
        model = load_policy(ModelConfig(path=str(model_dir), dtype="float32" if dtype == "fp32" else dtype,
                                        gradient_checkpointing=ckpt), lora, "cpu")
        if dtype == "fp32" and dropout == 0 and not ckpt and shared:
            rows.append((f"{label}: LoRA parameters r{lora.rank} on q/k/v/o",
                         memory.lora_params(shapes, lora.rank, lora.target_modules), real_lora_params(model)))
        b = 4 if dtype == "fp32" else 2
        est, _ = memory.activation_bytes(
            shapes, rows=prompts * group, prompt=p, completion=c, group=group, b=b, lora_rank=lora.rank,
            targets=lora.target_modules, dropout=dropout, checkpointing=ckpt, shared=shared and not ckpt,
            device="cpu")
        real = saved_activation_bytes(model, ids, mask, p, group if shared else 1)
        how = "checkpointing" if ckpt else ("shared prompts" if shared else "one pass")
        rows.append((f"{label}: activations, {dtype}, dropout {dropout:g}, {how}", est, real))
        del model
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", action="append", default=[], help="also check this model directory")
    args = ap.parse_args(argv)
    sys.path.insert(0, str(REPO / "tests"))
    from conftest import build_tiny_model_dir
    from transformers import AutoConfig

    from grpo.synthetic import architecture_config, random_model_dir

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        rows += check_model(build_tiny_model_dir(Path(tmp) / "tiny"), "tiny Llama")
        smol = architecture_config("smollm2-135m")
        rows += check_model(random_model_dir(Path(tmp) / "smol", smol), "SmolLM2-135M shape", heavy=False)
    for model in args.model:
        AutoConfig.from_pretrained(model)
        rows += check_model(Path(model), model, heavy=False)
    width = max(len(r[0]) for r in rows)
    print(f"{'part':<{width}}  {'estimate B':>14}  {'real B':>14}  ratio")
    for name, est, real in rows:
        print(f"{name:<{width}}  {est:>14,}  {real:>14,}  {est / real if real else math.nan:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
