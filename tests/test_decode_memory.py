"""grpo.rollout.decode_memory: one decode call's predicted bytes against a real cache and the H200's
measurement, and the split of a call that does not fit."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from grpo.rollout.decode_memory import (
    ALLOWANCE,
    CallSize,
    CompiledCall,
    allocator_budget,
    call_bytes,
    compiled_step_bytes,
    decode_working_bytes,
    model_dims,
    prompts_per_call,
    sampler_call_bytes,
    split_call,
)
from grpo.rollout.sampling import StaticLoop
from grpo.tools.synthetic import architecture_config

REPO = Path(__file__).resolve().parent.parent
GIB = 2**30


@pytest.fixture(scope="module")
def qwen_1_5b():
    """Seed 003's architecture on the meta device (shapes only, no memory)."""
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(architecture_config("qwen2-1.5b"), dtype=torch.bfloat16)


def test_the_terms_by_hand(qwen_1_5b):
    """A call of 2 prompts x 4 completions of 10 + 6 tokens: the decode phase (every row's KV cache,
    the prompts' cache, six (N, V) fp32 tensors) is the larger here; times 1 + ALLOWANCE. With
    log-probs of 64 rows the pass's KV cache and activations are weighed too."""
    per_token = 28 * 2 * 2 * 128 * 2  # layers x (K, V) x kv heads x head dim x bf16
    decoding = per_token * 8 * 16 + per_token * 2 * 10 + 6 * 8 * 151936 * 4
    assert sampler_call_bytes(qwen_1_5b, 2, 4, 10, 6) == int(decoding * (1 + ALLOWANCE))
    scoring = per_token * 8 * 16 + 8 * 6 * (3 * 8960 + 4 * 1536) * 2
    assert sampler_call_bytes(qwen_1_5b, 2, 4, 10, 6, 64) == int(max(decoding, scoring) * (1 + ALLOWANCE))
    long = sampler_call_bytes(qwen_1_5b, 2, 4, 10, 4000, 64)  # long completions: the log-prob pass leads
    assert long > sampler_call_bytes(qwen_1_5b, 2, 4, 10, 4000)


def test_a_call_is_split_to_the_most_prompts_that_fit(qwen_1_5b):
    """``prompts_per_call``: every prompt with no budget (off CUDA), else the most whose prediction
    fits, at least one."""
    one, five = (sampler_call_bytes(qwen_1_5b, n, 8, 128, 512, 64) for n in (1, 5))
    assert prompts_per_call(qwen_1_5b, 16, 8, 128, 512, None, 64) == 16
    assert prompts_per_call(qwen_1_5b, 16, 8, 128, 512, five, 64) == 5
    assert prompts_per_call(qwen_1_5b, 16, 8, 128, 512, five - 1, 64) == 4
    assert prompts_per_call(qwen_1_5b, 16, 8, 128, 512, one - 1, 64) == 1
    assert allocator_budget(torch.device("cpu")) is None


def test_the_call_prediction_covers_the_h200_measurement(qwen_1_5b):
    """SENT's call on the H200 (docs/gpu-runs/2026-11-28-h200: 16 prompts x 8 answers x 512 tokens of
    seed 003's 1.5B, dense bf16, log-probs): the prediction the check held it against was 7.961 GiB
    and the peak 8.731; the weights plus ``sampler_call_bytes`` must cover the peak. The prompt
    length is recovered from the recorded prediction (the weights plus ``decode_working_bytes``).
    Under the 8 GB card's cap (7.6 GiB, the weights already held) the call is split."""
    run = json.loads((REPO / "docs/gpu-runs/2026-11-28-h200/device_check.json").read_text())["samplers"]
    call, model = run["sent"], qwen_1_5b
    rows = call["prompts"] * call["samples"]
    positions = next(p for p in range(call["new_tokens"], 4096)
                     if run["weights_gib"] * GIB + decode_working_bytes(model, rows, p) >= call["predicted_gib"] * GIB)
    prompt = positions - call["new_tokens"]
    need = sampler_call_bytes(model, call["prompts"], call["samples"], prompt, call["new_tokens"], 64)
    assert run["weights_gib"] + need / GIB >= call["peak_allocated_gib"] > call["predicted_gib"]
    left = int((7.6 - run["weights_gib"]) * GIB)
    fits = prompts_per_call(model, call["prompts"], call["samples"], prompt, call["new_tokens"], left, 64)
    assert 1 <= fits < call["prompts"]
    assert sampler_call_bytes(model, fits, call["samples"], prompt, call["new_tokens"], 64) <= left


def test_a_compiled_call_counts_its_steps_buffers_beside_the_log_prob_pass(qwen_1_5b):
    """A call that makes its compiled step holds the step's buffers (``StaticCache``, mask, graph
    pool) in both phases, the log-prob pass included: it needs more than the same call on a step
    already held, by those buffers (times 1 + ALLOWANCE) where the log-prob pass is the larger phase;
    the uncompiled prediction is the one before compiled steps were counted."""
    d = model_dims(qwen_1_5b)
    new, held = CompiledCall(8, 128), CompiledCall(8, 128, new_step=False)
    with_step, on_held = (call_bytes(d, 5, 8, 128, 512, 64, c) for c in (new, held))
    kept = compiled_step_bytes(d, 64, 640)
    assert with_step - on_held == pytest.approx(kept * (1 + ALLOWANCE), abs=2)
    assert call_bytes(d, 5, 8, 128, 512, 64) == sampler_call_bytes(qwen_1_5b, 5, 8, 128, 512, 64)


def test_a_compiled_call_is_split_onto_a_step_already_held(qwen_1_5b):
    """``split_call``: with no budget every prompt in one call, padded to its bucket; with a step held
    for 16 rows x 640 positions, a call of 64 greedy prompts runs 16 a call on that step (no new
    step, no new cache) although more would fit beside it; a call too long for the held step makes
    a new one; with nothing held, the most prompts whose padded call fits."""
    d, loop = model_dims(qwen_1_5b), StaticLoop(StaticLoop.Options(length_bucket=64), compile_step=True)
    assert split_call(d, CallSize(64, 1, 128, 512), None, None, loop) == (64, CompiledCall(64, 128))
    big = 6 * GIB
    n, c = split_call(d, CallSize(64, 1, 100, 512), big, 64, loop, held=[(16, 640)])
    assert (n, c) == (16, CompiledCall(16, 128, new_step=False))
    n, c = split_call(d, CallSize(64, 1, 200, 512), big, 64, loop, held=[(16, 640)])
    assert c.new_step and c.prompt_len == 256 and n > 16
    n, c = split_call(d, CallSize(16, 8, 128, 512), int(3.5 * GIB), 64, loop)
    assert c.new_step and 1 <= n < 16 and call_bytes(d, n, 8, 128, 512, 64, c) <= 3.5 * GIB
    bigger = split_call(d, CallSize(n + 1, 8, 128, 512), None, 64, loop)[1]
    assert call_bytes(d, n + 1, 8, 128, 512, 64, bigger) > 3.5 * GIB


def test_an_uncompiled_loops_split_is_the_models_and_asks_no_step(qwen_1_5b):
    """``split_call`` on an uncompiled loop (it holds no step after a call): the most prompts whose
    uncompiled prediction fits, as ``prompts_per_call`` finds them, and no ``CompiledCall``."""
    d, loop, five = model_dims(qwen_1_5b), StaticLoop(), sampler_call_bytes(qwen_1_5b, 5, 8, 128, 512, 64)
    for budget in (None, five, five - 1, 1):
        want = prompts_per_call(qwen_1_5b, 16, 8, 128, 512, budget, 64)
        assert split_call(d, CallSize(16, 8, 128, 512), budget, 64, loop) == (want, None)
