"""Randomly initialised models and a character tokenizer, built offline in seconds.

Tests use them as tiny stand-ins for a real checkpoint; ``bench/grpo_step.py`` uses them to
measure a step at the exact architecture of a model whose weights cannot be downloaded
(memory and time depend on the shapes, not on the values of the weights).

The tokenizer maps every printable ASCII character to one token and has a chat template, so
prompts go through the same ``build_prompt`` path as a real model's. ``vocab_size`` pads the
vocabulary with filler tokens (``<t123>``) that encoding never produces but decoding accepts,
so a random model with a large vocabulary (151,936 for Qwen2) can sample any id.
"""

from __future__ import annotations

import string
from pathlib import Path

import torch

from grpo.core.architectures import ARCHITECTURES

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def char_tokenizer(vocab_size: int | None = None):
    """Character-level fast tokenizer with a chat template; ``vocab_size`` pads with filler tokens."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tokens = specials + [c for c in string.printable if c not in "\x0b\x0c"]
    if vocab_size is not None:
        if vocab_size < len(tokens):
            raise ValueError(f"vocab_size: at least {len(tokens)} (the characters), got {vocab_size}")
        tokens += [f"<t{i}>" for i in range(len(tokens), vocab_size)]
    core = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=[], unk_token=None,
                                ignore_merges=True))
    core.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    return tok


def random_model_dir(path: str | Path, config, *, seed: int = 0, dtype: torch.dtype = torch.float32,
                     device: str = "cpu") -> Path:
    """Save a randomly initialised causal LM of ``config`` (a transformers config) with a matching
    character tokenizer at ``path``; loadable by ``grpo.model.lora_policy.load_policy`` like any checkpoint."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    tok = char_tokenizer(config.vocab_size)
    config.eos_token_id, config.pad_token_id, config.bos_token_id = tok.eos_token_id, tok.pad_token_id, None
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    del model
    return path


def architecture_config(name: str):
    """The transformers config (``Qwen2Config`` unless the entry names another ``model_type``) of a
    named entry of ``grpo.core.architectures.ARCHITECTURES``."""
    from transformers import AutoConfig

    if name not in ARCHITECTURES:
        raise ValueError(f"arch: unknown {name!r}; known: {', '.join(ARCHITECTURES)}")
    fields = dict(ARCHITECTURES[name])
    return AutoConfig.for_model(fields.pop("model_type", "qwen2"), **fields)
