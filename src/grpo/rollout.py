"""Generation backends behind one interface.

A backend turns prompt texts into a ``Rollout``:

    backend.generate(prompts: list[str], num_samples: int, *, max_new_tokens, temperature, top_p)

Each prompt is sampled ``num_samples`` times; the completions of a prompt are contiguous in the
result. ``TransformersBackend`` uses ``model.generate`` (left padding, sampling, stop at EOS) on
the policy being trained, so its rollouts are always on-policy; with ``dequantize=True`` the
4-bit layers are dequantised once per call instead of once per token (the trainer turns this on
for CPU runs, where it is ~15% faster and costs a temporary dense copy). A vLLM backend
implements the same method.
"""

from __future__ import annotations

import contextlib
from typing import Protocol

import torch

from grpo.models import dequantized_weights
from grpo.types import Rollout


class RolloutBackend(Protocol):
    def generate(
        self, prompts: list[str], num_samples: int, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0
    ) -> Rollout: ...


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_ids: set[int]) -> torch.Tensor:
    """(N, C) mask: 1 up to and including the first EOS token of each row, 0 after it."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= completion_ids == eos
    # number of EOS tokens strictly before each position; valid while it is zero
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # (N, C)
    return (before == 0).long()


class TransformersBackend:
    """Sampling with ``transformers`` ``generate`` on the (peft) policy itself."""

    def __init__(self, model, tokenizer, max_prompt_tokens: int | None = None, dequantize: bool = False):
        self.model = model
        self.dequantize = dequantize
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        eos = tokenizer.eos_token_id
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {eos} if eos is not None else set()
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(gen_eos)
        self.eos_ids = ids

    @torch.no_grad()
    def generate(
        self, prompts: list[str], num_samples: int, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0
    ) -> Rollout:
        tok = self.tokenizer
        tok.padding_side = "left"
        enc = tok(
            prompts,
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
            truncation=self.max_prompt_tokens is not None,
            max_length=self.max_prompt_tokens,
        )
        device = next(self.model.parameters()).device
        prompt_ids = enc["input_ids"].repeat_interleave(num_samples, dim=0).to(device)  # (N, P)
        prompt_mask = enc["attention_mask"].repeat_interleave(num_samples, dim=0).to(device)  # (N, P)
        was_training = self.model.training
        self.model.eval()
        dense = dequantized_weights(self.model) if self.dequantize else contextlib.nullcontext()
        try:
            with dense:
                out = self.model.generate(
                    input_ids=prompt_ids,
                    attention_mask=prompt_mask,
                    do_sample=True,
                    temperature=temperature,
                    top_p=top_p,
                    top_k=0,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=sorted(self.eos_ids),
                    pad_token_id=tok.pad_token_id,
                    use_cache=True,
                )
        finally:
            self.model.train(was_training)
        completion_ids = out[:, prompt_ids.shape[1]:]  # (N, C)
        completion_mask = completion_mask_from_eos(completion_ids, self.eos_ids)  # (N, C)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id)
        texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, texts)
