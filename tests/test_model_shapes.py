"""A model's shapes from its config.json (``grpo.core.model_shapes``): counted on the meta device as
``from_pretrained`` builds the model; a prepared directory without a config is one line."""

from __future__ import annotations

import json

import pytest

from grpo.core.model_shapes import count, decoder_linears, norm_params, prepared_name, prepared_shapes


def test_the_tiny_models_shapes_from_its_config(tiny_model_dir):
    """The tiny Llama: 2 layers, hidden 64, 4 heads / 2 KV heads of 16, intermediate 128; seven
    linears a layer, all quantised by bitsandbytes, the LM head not."""
    shapes = prepared_shapes(tiny_model_dir)
    assert shapes.source == str(tiny_model_dir / "config.json")
    assert (shapes.layers, shapes.hidden, shapes.heads, shapes.kv_heads, shapes.head_dim, shapes.intermediate) == (
        2, 64, 4, 2, 16, 128)
    assert len(decoder_linears(shapes)) == 2 * 7 and len(shapes.layer_linears()) == 7
    assert all(x.quantized for x in decoder_linears(shapes))
    assert not any(x.quantized for x in shapes.linears if ".layers." not in x.name)  # the LM head
    assert shapes.quantized_params == 2 * (2 * 64 * 64 + 2 * 64 * 32 + 3 * 64 * 128)  # q, o; k, v; gate, up, down
    assert norm_params(shapes) == (2 * 2 + 1) * 64
    assert shapes.total_params == shapes.quantized_params + shapes.other_params


def test_a_directory_without_a_config_is_one_line(tmp_path):
    with pytest.raises(FileNotFoundError) as err:
        prepared_shapes(tmp_path / "models" / "base")
    assert "\n" not in str(err.value) and str(err.value).startswith(f"{tmp_path}/models/base/config.json: no such file")


def test_prepared_name_and_count(tmp_path):
    assert prepared_name(tmp_path) is None
    (tmp_path / "manifest.json").write_text(json.dumps({"name": "someone/model"}))
    assert prepared_name(tmp_path) == "someone/model"
    assert [count(x) for x in (1.54e9, 4.36e6, 12_000, 999)] == ["1.54 B", "4.36 M", "12 k", "999"]
