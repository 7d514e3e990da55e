"""The named architectures (``grpo.core.architectures``): plain data, no torch; the model names that map
to each (hub ids, base and instruct, this project's aliases), and the names that do not."""

from __future__ import annotations

import subprocess
import sys

import pytest

from grpo.core.architectures import ARCHITECTURES, MODEL_ARCHITECTURES, architecture_for_model


@pytest.mark.parametrize(("name", "arch"), [
    ("deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B", "qwen2-1.5b"),
    ("HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m"),
    ("smollm2-135m-instruct", "smollm2-135m"),  # this project's alias
    ("Qwen/Qwen2.5-7B-Instruct/", "qwen2.5-7b"),
    ("Qwen/Qwen2.5-7B", "qwen2.5-7b"),
    ("Qwen/Qwen2.5-72B-Instruct", None),  # a prefix of the stem is not the stem
    ("HuggingFaceTB/SmolLM2-1.7B-Instruct", None),
    ("someone/unknown-model", None),
])
def test_model_names_map_to_their_architecture(name, arch):
    assert architecture_for_model(name) == arch


def test_every_model_maps_to_a_known_architecture_and_nothing_heavy_is_imported():
    assert set(MODEL_ARCHITECTURES.values()) <= set(ARCHITECTURES)
    code = "import sys, grpo.core.architectures; print(any(m in sys.modules for m in ('torch', 'transformers')))"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip() == "False"
