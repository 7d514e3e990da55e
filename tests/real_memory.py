"""The real objects ``grpo check``'s memory estimate is checked against (``tests/test_memory.py``):
peft's trainable parameters, bitsandbytes' 4-bit storage, a generation's KV cache, the activations
a training forward saves for backward. (Once ``bench/memory_estimate.py``, which printed the same
checks at the full 30-layer shape: ``git show 4fa4e9b:bench/memory_estimate.py``.)"""

from __future__ import annotations


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

    from grpo.algorithm.logprobs import completion_hidden
    from grpo.model.lora_policy import lm_parts

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
