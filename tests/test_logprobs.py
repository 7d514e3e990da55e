"""``grpo.logprobs``: the shared-prompt forward of a group equals the full forward."""

from __future__ import annotations

import pytest
import torch

from grpo.config import LoraConfig, ModelConfig
from grpo.policy import load_policy

from .helpers import LORA


@pytest.mark.parametrize("checkpointing", [False, True])
def test_shared_prompt_forward_equals_full_forward_values_and_lora_grads(tiny_model_dir, checkpointing):
    """Two groups of G = 3 rows, prompts of different lengths (left padding), completions with
    padding: the shared-prompt forward gives the full forward's hidden states and LoRA gradients
    (with gradient checkpointing it falls back to the full forward, so they match trivially)."""
    from grpo.logprobs import completion_hidden
    from grpo.policy import lm_parts

    torch.manual_seed(0)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), gradient_checkpointing=checkpointing),
                        LoraConfig(**LORA))
    for n, p in model.named_parameters():
        if "lora_B" in n:
            torch.nn.init.normal_(p, std=0.3)
    model.train()
    body, head = lm_parts(model)
    prompts = torch.tensor([[0, 0, 5, 6, 7], [8, 9, 10, 11, 12]]).repeat_interleave(3, 0)  # (6, 5)
    p_mask = (prompts != 0).long()
    completions = torch.randint(3, 90, (6, 4))
    c_mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 0]] * 2)
    ids, mask = torch.cat([prompts, completions], 1), torch.cat([p_mask, c_mask], 1)
    weights = torch.randn(6, 4, 64)
    results = []
    for g in (1, 3):
        model.zero_grad()
        hidden = completion_hidden(body, ids, mask, 5, group_size=g)  # (6, 4, 64)
        (hidden * weights * c_mask.unsqueeze(-1)).sum().backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((hidden.detach(), grads))
    (h_full, g_full), (h_shared, g_shared) = results
    torch.testing.assert_close(h_shared * c_mask.unsqueeze(-1), h_full * c_mask.unsqueeze(-1), rtol=1e-4, atol=1e-5)
    for n in g_full:
        torch.testing.assert_close(g_shared[n], g_full[n], rtol=1e-3, atol=1e-4)  # float reassociation
