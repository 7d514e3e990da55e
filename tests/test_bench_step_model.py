"""bench/step_model.py at tiny shapes: its counts follow the shapes of the real code it runs (the
update's FLOPs scale with its rows, its launches with the micro-batches and ``mu``, a decode step's
FLOPs with its rows), its per-op FLOPs add up to torch's flop counter, and bitsandbytes' kernel
choice is read from the pinned package.

The bench runs in a child process: its C++ shim (bench/fake_cuda) must be loaded before torch.
"""

import json
import subprocess
import sys

import pytest
import yaml

from .conftest import REPO

BENCH = REPO / "bench" / "step_model.py"
TINY = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=256, vocab_size=32000, tie_word_embeddings=False, max_position_embeddings=1024)


def tiny_workspace(path, prompts: int):
    """A workspace whose model is a tiny Qwen2 config.json (no weights), seed 003's switches (NF4,
    gradient checkpointing, several micro-batches) and ``prompts`` prompts of G = 4 a step."""
    from transformers import AutoConfig

    AutoConfig.for_model("qwen2", **TINY).save_pretrained(path / "models" / "tiny")
    (path / "dvc.yaml").write_text("stages: {}\n")
    params = {"model": {"path": "models/tiny", "quantization": "nf4", "gradient_checkpointing": True},
              "lora": {"rank": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
              "train": {"passes": {"micro_batches": 2},
                        "rollouts": {"prompts_per_step": prompts, "group_size": 4, "max_new_tokens": 16}}}
    (path / "params.yaml").write_text(yaml.safe_dump(params))
    return path / "params.yaml"


def run_bench(tmp_path, prompts: int, variants: str) -> dict:
    work = tmp_path / f"p{prompts}"
    params = tiny_workspace(work, prompts)
    out = work / "figures.json"
    run = subprocess.run([sys.executable, str(BENCH), "--params", str(params), "--prompt-tokens", "16",
                          "--variants", variants, "--json", str(out)], capture_output=True, text=True, cwd=REPO,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert "top operators" in run.stdout
    return json.loads(out.read_text())


@pytest.mark.slow
def test_counts_follow_the_shapes(tmp_path):
    two = run_bench(tmp_path, 2, "micro_batches 1,micro_batches 4,mu 2")
    four = run_bench(tmp_path, 4, "none")
    for part in ("update", "decode_token"):
        for figures in (two, four):
            d = figures[part]
            assert d["flops"] > 0 and d["bytes"] > 0 and d["launches"] > 0, part
            # the per-op sum is torch's flop counter's total (bitsandbytes' gemm added to both)
            assert d["flops"] == pytest.approx(d["flop_counter_flops"], rel=1e-9), part
            # the slower card is slower, and each card's time is its roofline plus its launches
            assert d["seconds"]["rtx3060ti"] > d["seconds"]["h200"] > 0
            for card in d["cards"].values():
                assert card["seconds"] == pytest.approx(card["roofline_s"] + card["launch_s"])
                assert card["top_ops"][0]["seconds"] >= card["top_ops"][-1]["seconds"]
    # twice the rows: about twice the update's arithmetic (attention grows with rows, not faster)
    assert two["update"]["shape"]["rows"] * 2 == four["update"]["shape"]["rows"]
    assert 1.8 < four["update"]["flops"] / two["update"]["flops"] < 2.2
    # a decode step: twice the rows, twice the FLOPs, the same kernels
    assert 1.8 < four["decode_token"]["flops"] / two["decode_token"]["flops"] < 2.2
    assert four["decode_token"]["launches"] == two["decode_token"]["launches"]
    # launches grow with the micro-batches; the arithmetic stays (the same update)
    v = two["variants"]
    base = two["update"]
    assert v["micro_batches 1"]["launches"] < base["launches"] < v["micro_batches 4"]["launches"]
    assert v["micro_batches 4"]["flops"] == pytest.approx(base["flops"], rel=0.05)
    # mu 2: two updates instead of one (the default's rule has no reference pass)
    assert base["shape"]["mu"] == 1 and v["mu 2"]["shape"]["mu"] == 2 and not base["shape"]["reference_pass"]
    assert 1.6 * base["flops"] < v["mu 2"]["flops"] < 2.2 * base["flops"]
    # the measured figures it is set beside come from the device runs' JSON
    assert two["measured"]["update"]["seconds"] > 0 and two["measured"]["decode"]["static_launches_per_token"] > 0


def test_bitsandbytes_kernel_choice_is_the_packages():
    """The fused 4-bit kernel below bitsandbytes' floor of rows, dequantisation + F.linear past its
    most rows, whatever the card: the heuristic and its limits come from the installed package."""
    import torch

    sys.path.insert(0, str(REPO / "bench"))
    from step_model import CARDS, Bnb4bitGemm

    gemm = Bnb4bitGemm()
    assert gemm.path.is_file() and gemm.line > 0
    floor = gemm._consts["_GEMM_4BIT_CUSTOM_FLOOR_M"]
    for card in CARDS.values():
        assert gemm.custom(card, torch.bfloat16, floor, 8960, 1536, 64)
        assert not gemm.custom(card, torch.bfloat16, gemm.max_m + 1, 8960, 1536, 64)
