"""``bench/generation_roofline.py``: the matmul floor is computed from the model's own shapes."""

import json
import sys

from .conftest import REPO

BENCH = REPO / "bench" / "generation_roofline.py"


def test_roofline_counts_every_linear_weight_of_the_model(tiny_model_dir):
    """The matmul floor's shapes are the model's own: their FLOPs per token are 2 x its linear weights."""
    import torch
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(BENCH.parent))
    try:
        from generation_roofline import linear_shapes
    finally:
        sys.path.remove(str(BENCH.parent))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert sum(k * n for k, n in linear_shapes(config)) == weights
