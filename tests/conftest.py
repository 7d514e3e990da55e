"""Shared fixtures: a tiny random Llama with a character-level tokenizer and a chat template.

Everything here is built offline in about a second; no test downloads anything.
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import pytest

# Without a GPU, Triton kernels run (and are tested) in Triton's CPU interpreter.
if not os.path.exists("/dev/nvidia0"):
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("DVC_STUDIO_OFFLINE", "true")
os.environ.setdefault("DVC_NO_ANALYTICS", "1")

REPO = Path(__file__).resolve().parents[1]

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tiny_tokenizer():
    """Character-level tokenizer: every printable ASCII character is one token."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    chars = [c for c in string.printable if c not in "\x0b\x0c"]
    vocab = {tok: i for i, tok in enumerate(specials + chars)}
    core = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token=None, ignore_merges=True))
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


def build_tiny_model_dir(path: Path, seed: int = 0, hidden: int = 64, heads: int = 4, kv_heads: int = 2) -> Path:
    """A 2-layer random Llama (hidden 64 by default) saved with the tiny tokenizer at ``path``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = build_tiny_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=2,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        bos_token_id=None,
    )
    model = LlamaForCausalLM(cfg)
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_vllm_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama with head_dim 64: vLLM's CPU attention rejects head_dim 16."""
    return build_tiny_model_dir(tmp_path_factory.mktemp("tiny-llama-hd64"), hidden=128, heads=2, kv_heads=1)


@pytest.fixture(scope="session")
def tiny_problems() -> list[dict]:
    return [
        {"id": f"p{i}", "question": f"What is {a} + {b}?", "answer": str(a + b), "solution": ""}
        for i, (a, b) in enumerate([(1, 2), (3, 4), (2, 2), (5, 1), (6, 3), (0, 7), (4, 4), (8, 1)])
    ]


def make_dvc_workspace(ws: Path, params: dict) -> Path:
    """A temporary git + DVC repo holding this project's stages, code and ``params``."""
    import shutil
    import subprocess
    import sys

    import yaml

    for name in ("tasks", "src", "flows"):
        shutil.copytree(REPO / name, ws / name, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    shutil.copy(REPO / "dvc.yaml", ws / "dvc.yaml")
    (ws / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for cmd in (["git", "init", "-q"], ["git", "config", "user.email", "ci@example.com"], ["git", "config", "user.name", "ci"],
                [sys.executable, "-m", "dvc", "init", "-q"], [sys.executable, "-m", "dvc", "config", "core.analytics", "false"],
                ["git", "add", "-A"], ["git", "commit", "-qm", "tiny pipeline"]):
        subprocess.run(cmd, cwd=ws, check=True, capture_output=True)
    return ws
