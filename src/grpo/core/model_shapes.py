"""A causal LM's shapes, counted from its ``config.json`` on PyTorch's ``meta`` device (no memory,
no weights): what the engine's memory arithmetic (``grpo.rollout.engine.needs``) and the step's estimate
(``grpo.tools.memory``) both count with.

``model_shapes(config)`` builds the model from a transformers config and counts every
``nn.Linear``, the embeddings and which layers bitsandbytes quantises, exactly as
``from_pretrained`` would build them. ``prepared_shapes(model_dir)`` reads the config of a model
directory prepare_model wrote (the train stage's only source of shapes); ``grpo.tools.memory.resolve_config``
adds the estimate's fallback for a model not prepared yet (``grpo.tools.synthetic``'s named architectures).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: int
    out_features: int
    quantized: bool

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def params(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class ModelShapes:
    """The sizes the estimate needs, counted from a model built on the meta device."""

    source: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    linears: tuple[Linear, ...]
    other_params: int  # every parameter outside the quantised linears' weights
    total_params: int = 0

    @property
    def quantized_params(self) -> int:
        return sum(x.params for x in self.linears if x.quantized)

    def layer_linears(self) -> list[Linear]:
        """The linears of the first decoder layer (every layer has the same)."""
        first = next(x.name for x in self.linears if ".layers." in x.name)
        prefix = first[: first.index(".layers.") + len(".layers.")]
        index = first[len(prefix):].split(".", 1)[0]
        return [x for x in self.linears if x.name.startswith(f"{prefix}{index}.")]


def model_shapes(config, source: str = "") -> ModelShapes:
    """Count the modules of ``config``'s causal LM, built on the meta device (no memory, no weights).
    A linear is quantised when bitsandbytes would quantise it (transformers'
    ``get_keys_to_not_convert``: the LM head and tied weights stay in the compute dtype)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = set(get_keys_to_not_convert(model))
    linears = []
    quantized_weights = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            quantized = not any(name == s or name.startswith(s + ".") for s in skip)
            linears.append(Linear(name, module.in_features, module.out_features, quantized))
            quantized_weights += module.weight.numel() if quantized else 0
    total = sum(p.numel() for p in model.parameters())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShapes(
        source=source, hidden=config.hidden_size, intermediate=config.intermediate_size,
        layers=config.num_hidden_layers, heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim, vocab=config.vocab_size, linears=tuple(linears), other_params=total - quantized_weights,
        total_params=total,
    )


def prepared_shapes(model_dir: str | Path) -> ModelShapes:
    """The shapes of the model in ``model_dir`` from its ``config.json`` (the directory prepare_model
    writes, which exists whenever the train stage runs); ``FileNotFoundError`` of one line without one."""
    config = Path(model_dir) / "config.json"
    if not config.is_file():
        raise FileNotFoundError(f"{config}: no such file; the engine's arithmetic reads the prepared model's "
                                "config.json (run prepare_model first)")
    from transformers import AutoConfig

    return model_shapes(AutoConfig.from_pretrained(config.parent), str(config))


def prepared_name(model_dir: Path) -> str | None:
    """The ``model.name`` prepare_model wrote ``model_dir`` from (its ``manifest.json``), or None
    (no manifest: not prepared by the pipeline, or not there)."""
    try:
        return json.loads((model_dir / "manifest.json").read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return None


def norm_params(shapes: ModelShapes) -> int:
    """Parameters of the norms of a Llama-style decoder: two per layer and the final one."""
    return (2 * shapes.layers + 1) * shapes.hidden


def decoder_linears(shapes: ModelShapes) -> list[Linear]:
    """The linears of every decoder layer (not the LM head)."""
    return [x for x in shapes.linears if ".layers." in x.name]


def count(x: float) -> str:
    """1.54 B, 4.36 M, 12 k: a count in a few characters."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return str(int(x))
