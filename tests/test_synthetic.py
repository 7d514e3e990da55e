"""The offline stand-ins (``grpo.tools.synthetic``): the character tokenizer (one token a character, its chat
template, filler tokens past the characters), random model directories that load like a checkpoint and
repeat by seed, and the named architectures' configs (the names the models map to:
tests/test_architectures.py)."""

from __future__ import annotations

import string

import pytest
import torch

from grpo.tools.synthetic import (
    ARCHITECTURES,
    architecture_config,
    char_tokenizer,
    random_model_dir,
)

CHARS = [c for c in string.printable if c not in "\x0b\x0c"]


def test_every_character_is_one_token_and_decodes_back():
    tok = char_tokenizer()
    text = "What is 12 + 30?\n#### 42\t{ok} ~`|"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert len(tok) == 3 + len(CHARS) and tok.convert_tokens_to_ids(CHARS[0]) == 3
    assert (tok.eos_token, tok.pad_token, tok.bos_token) == ("<|im_end|>", "<|endoftext|>", None)
    assert tok("<|im_end|>", add_special_tokens=False)["input_ids"] == [tok.eos_token_id]  # a special is one token


def test_the_chat_template_by_hand():
    tok = char_tokenizer()
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+2?"}]
    assert tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2+2?<|im_end|>\n<|im_start|>assistant\n")
    assert tok.apply_chat_template(messages[1:], tokenize=False) == "<|im_start|>user\n2+2?<|im_end|>\n"


def test_vocab_size_pads_with_fillers_that_decode_and_are_never_encoded():
    tok = char_tokenizer(vocab_size=300)
    assert len(tok) == 300
    assert tok.decode([299]) == "<t299>" and tok.convert_tokens_to_ids("<t150>") == 150
    assert max(tok("<t150> and text", add_special_tokens=False)["input_ids"]) < 3 + len(CHARS)
    assert len(char_tokenizer(vocab_size=3 + len(CHARS))) == 3 + len(CHARS)
    with pytest.raises(ValueError, match=f"at least {3 + len(CHARS)}"):
        char_tokenizer(vocab_size=50)


def _tiny_config(vocab: int):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                       num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64)


def test_a_random_model_dir_loads_like_a_checkpoint_and_repeats_by_seed(tmp_path):
    """The directory holds the model and a tokenizer of its vocabulary; eos and pad ids are the
    tokenizer's in the config and the generation config; the same seed gives the same weights, another
    seed others."""
    from transformers import AutoModelForCausalLM

    from grpo.model.base_model import load_tokenizer

    vocab = 128
    dirs = [random_model_dir(tmp_path / name, _tiny_config(vocab), seed=seed)
            for name, seed in (("a", 1), ("b", 1), ("c", 2))]
    models = [AutoModelForCausalLM.from_pretrained(d) for d in dirs]
    tok = load_tokenizer(dirs[0])
    assert len(tok) == vocab == models[0].config.vocab_size
    cfg, gen = models[0].config, models[0].generation_config
    assert (cfg.eos_token_id, cfg.pad_token_id, cfg.bos_token_id) == (tok.eos_token_id, tok.pad_token_id, None)
    assert (gen.eos_token_id, gen.pad_token_id) == (tok.eos_token_id, tok.pad_token_id)
    weights = [dict(m.named_parameters()) for m in models]
    assert all(torch.equal(p, weights[1][n]) for n, p in weights[0].items())
    assert not all(torch.equal(p, weights[2][n]) for n, p in weights[0].items())


def test_named_architectures_build_their_configs():
    """Qwen2 unless the entry names another type (SmolLM2: Llama, every time: the entry is not
    consumed); the fields are the entry's; an unknown name lists the known ones."""
    from transformers import LlamaConfig, Qwen2Config

    qwen = architecture_config("qwen2-1.5b")
    assert isinstance(qwen, Qwen2Config)
    assert (qwen.hidden_size, qwen.num_hidden_layers, qwen.num_key_value_heads, qwen.vocab_size) == (1536, 28, 2, 151936)
    for _ in range(2):
        smol = architecture_config("smollm2-135m")
        assert isinstance(smol, LlamaConfig) and smol.tie_word_embeddings and smol.hidden_size == 576
    for name, fields in ARCHITECTURES.items():
        assert fields["hidden_size"] % fields["num_attention_heads"] == 0, name
        assert fields["num_attention_heads"] % fields["num_key_value_heads"] == 0, name
    with pytest.raises(ValueError, match="unknown 'llama-70b'; known: qwen2-1.5b, toy"):
        architecture_config("llama-70b")
