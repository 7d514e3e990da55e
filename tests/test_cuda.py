"""One GRPO training step on CUDA with the 4-bit NF4 base + LoRA (skipped without a CUDA device),
and, on the CPU, the dtype every cuda-marked test runs in on a card.

The tiny random Llama of ``conftest.py`` in bitsandbytes NF4 on the GPU, the card's 16-bit compute
dtype (``model.dtype: auto``), LoRA on q/k/v/o, gradient checkpointing, two micro-batches, KL
against the adapter-disabled reference, and the Triton entropy/log-prob kernel (``kernel: auto``
picks it on CUDA).

``pytest -m cuda`` (bench/device_check.py's tests phase) runs every cuda-marked test of tests/ on the card it finds;
``test_the_cuda_tests_run_in_the_cards_16_bit_dtype`` lists here what dtype each would run in on a
card of compute capability 7.5 and of 8.6, from the rules their fixtures apply
(tests/helpers.py ``DTYPE_FIXTURES``).
"""

from __future__ import annotations

import importlib

import pytest
import torch

from grpo.algorithm.rewards import REWARDS
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.config.sections.train import TrainConfig
from grpo.core.device import cuda_capability, cuda_half_dtype
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy

from .conftest import REPO
from .helpers import DTYPE_FIXTURES, make_trainer, model_test_dtype

CARDS = {(7, 5): "float16", (8, 6): "bfloat16"}
"""Compute capability -> the dtype every cuda-marked test must run in on such a card: a Turing
card (T4, RTX 20xx), below 8.0, where vLLM refuses bf16, and an Ampere one (A10, RTX 30xx)."""


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_one_4bit_lora_step_on_cuda(tiny_model_dir, auto_dtype, tiny_problems, tmp_path, monkeypatch):
    import bitsandbytes as bnb

    # a reward that differs within every group, so the update is non-zero whatever the model samples
    monkeypatch.setitem(REWARDS, "chars", lambda completions, answers: [float(len(c)) for c in completions])
    kernels = importlib.import_module("grpo.algorithm.kernels.entropy_logprob")
    triton_calls = []
    real_triton = kernels.entropy_logprob_triton
    monkeypatch.setattr(kernels, "entropy_logprob_triton",
                        lambda *a, **kw: triton_calls.append(a[0].shape) or real_triton(*a, **kw))

    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir), dtype=auto_dtype, gradient_checkpointing=True),
                        LoraConfig(rank=8, alpha=16), "cuda")
    four_bit = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert four_bit and all(m.weight.device.type == "cuda" and m.weight.quant_state.quant_type == "nf4"
                            for m in four_bit)
    assert four_bit[0].compute_dtype == cuda_half_dtype(cuda_capability())  # auto: the card's 16-bit dtype
    cfg = TrainConfig(output_dir=str(tmp_path), steps=1, rewards={"correctness": 1.0, "chars": 0.01}, truncated="score", rollouts={"prompts_per_step": 2, "group_size": 4, "max_new_tokens": 8}, passes={"micro_batches": 2}, loss={"beta": 0.04, "entropy_rule": "high"}, checkpoints={"every": 0})  # a random model writes all 8 tokens: scored, so the groups have signal
    before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    (row,) = make_trainer(model, tok, cfg, tiny_problems).train(progress=False)

    assert row["step"] == 1 and row["completion_len"] > 0
    assert row["peak_mem_mb"] > 0 and row["peak_reserved_mb"] >= row["peak_mem_mb"]
    assert triton_calls  # the fused kernel computed the entropies and log-probs
    assert 0 < row["kept_frac"] <= 0.35
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, before[n])]
    assert changed and all("lora_" in n for n in changed)
    assert all(p.device.type == "cuda" for p in model.parameters() if p.requires_grad)


def cuda_tests() -> dict[str, set[str]]:
    """Every cuda-marked test of tests/ as ``pytest -m cuda`` collects it (collected in this
    process, nothing run): node id -> the fixtures it uses, directly or through other fixtures."""
    found: dict[str, set[str]] = {}

    class Recorder:
        def pytest_collection_finish(self, session):
            found.update({item.nodeid: set(item.fixturenames) for item in session.items})

    files = [str(p) for p in sorted((REPO / "tests").glob("test_*.py")) if "mark.cuda" in p.read_text()]
    code = pytest.main(["--collect-only", "-qq", "-m", "cuda", "-p", "no:cacheprovider", "--rootdir", str(REPO), *files],
                       plugins=[Recorder()])
    assert code == 0, f"collecting the cuda-marked tests failed ({code})"
    return found


def test_the_cuda_tests_run_in_the_cards_16_bit_dtype():
    """What ``pytest -m cuda`` would run each test in on a card of compute capability 7.5 and 8.6,
    from the rule of the dtype fixture it takes (``DTYPE_FIXTURES``): fp16 at 7.5, bf16 at 8.6, so
    never an fp32 engine (vLLM's LoRA kernels take fp16 and bf16 only) and never bf16 below 8.0
    (vLLM refuses it). A cuda-marked test that takes no dtype fixture makes its own tensors and
    is a kernel test (tests/test_kernels.py: no model, no engine). Printed with ``-s``."""
    listing, own_tensors = {}, []
    for nodeid, fixtures in sorted(cuda_tests().items()):
        rules = [DTYPE_FIXTURES[name] for name in sorted(fixtures & DTYPE_FIXTURES.keys())]
        if not rules:
            own_tensors.append(nodeid)
            continue
        listing[nodeid] = {card: {rule("cuda", card) for rule in rules} for card in CARDS}
    for nodeid, dtypes in listing.items():
        print(nodeid, "  ".join(f"{major}.{minor}: {'/'.join(sorted(d))}" for (major, minor), d in dtypes.items()))
    print(*(f"{nodeid} a kernel test: its own tensors" for nodeid in own_tensors), sep="\n")

    strays = [n for n in own_tensors if not n.startswith("tests/test_kernels.py::")]
    assert not strays, f"cuda-marked tests that take no dtype fixture (tests/helpers.py DTYPE_FIXTURES): {strays}"
    wrong = {n: d for n, d in listing.items() if d != {card: {dtype} for card, dtype in CARDS.items()}}
    assert not wrong, f"cuda-marked tests not in the card's 16-bit dtype: {wrong}"
    assert {n.split("::")[0] for n in listing} >= {f"tests/test_{name}.py" for name in (
        "cuda", "engine_nf4_form", "engine_policy_engine", "engine_sampler", "evaluate", "kernels")}  # all were found
    assert model_test_dtype("cpu", None) == "float32"  # on a CPU the engine tests keep their fp32 bounds
