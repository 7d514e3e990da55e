"""The model architectures the project knows by name, as plain data (no torch, no transformers):
each one's ``config.json`` fields (``ARCHITECTURES``) and the models that are one
(``MODEL_ARCHITECTURES``, ``architecture_for_model``).

``grpo.tools.synthetic`` builds their transformers configs and random models of them; ``grpo.core.device``
reads a hub id's ``model_type`` here before anything is downloaded, and ``grpo.tools.memory`` estimates
a model not prepared yet. Apart from ``grpo.tools.synthetic`` so that the stages, which all reach this
through ``grpo.core.device``, do not depend on the random-model builders.
"""

from __future__ import annotations

# The exact shapes of deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B (its config.json): Qwen2, untied
# LM head, 151,936 tokens. ``toy`` keeps the vocabulary and the GQA layout at a CPU-friendly width.
# ``smollm2-135m`` (HuggingFaceTB/SmolLM2-135M-Instruct, Llama, tied) and ``qwen2.5-7b``
# (Qwen/Qwen2.5-7B-Instruct) copy those models' config.json too; ``model_type`` (default qwen2)
# picks the transformers config class.
ARCHITECTURES: dict[str, dict] = {
    "qwen2-1.5b": dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, tie_word_embeddings=False, rope_theta=10000.0,
        max_position_embeddings=131072, rms_norm_eps=1e-6,
    ),
    "toy": dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=151936, tie_word_embeddings=False, rope_theta=10000.0,
        max_position_embeddings=4096, rms_norm_eps=1e-6,
    ),
    "smollm2-135m": dict(
        model_type="llama", hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
        intermediate_size=1536, vocab_size=49152, tie_word_embeddings=True, rope_theta=100000.0,
        max_position_embeddings=8192, rms_norm_eps=1e-5,
    ),
    "qwen2.5-7b": dict(
        hidden_size=3584, num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4,
        intermediate_size=18944, vocab_size=152064, tie_word_embeddings=False, rope_theta=1000000.0,
        max_position_embeddings=32768, rms_norm_eps=1e-6,
    ),
}

# Models (``model.name``: a hub id or this project's alias) whose architecture is an entry above;
# matched case-insensitively on the name's last path part, base and instruct variants alike.
MODEL_ARCHITECTURES: dict[str, str] = {
    "deepseek-r1-distill-qwen-1.5b": "qwen2-1.5b",
    "smollm2-135m": "smollm2-135m",
    "qwen2.5-7b": "qwen2.5-7b",
}


def architecture_for_model(model_name: str) -> str | None:
    """The ``ARCHITECTURES`` entry of a model name (``deepseek-ai/DeepSeek-R1-Distill-Qwen-1.5B`` ->
    ``qwen2-1.5b``, ``smollm2-135m-instruct`` -> ``smollm2-135m``), or None."""
    leaf = model_name.rstrip("/").rsplit("/", 1)[-1].lower()
    for stem, arch in MODEL_ARCHITECTURES.items():
        if leaf == stem or leaf.startswith(stem + "-"):
            return arch
    return None
