"""grpo.engine.sampler: a saved model's vLLM sampler: log-probs, a real shutdown, calls seeded in
this process."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from grpo.base_model import load_tokenizer
from grpo.config import VLLMEngineConfig
from grpo.engine.sampler import saved_model_sampler

from .helpers import ENGINE_RAM


@pytest.mark.slow
@pytest.mark.cuda
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_closed_engine_is_gone(tiny_vllm_model_dir, auto_dtype):
    """``vllm`` on a model directory: a ``VLLMSampler`` with log-probs; it cannot follow a policy
    (sync says so instead of sampling stale weights); close is idempotent and nothing runs after it.
    In ``auto`` (``pytest -m cuda``: the card's 16-bit dtype)."""
    tok = load_tokenizer(tiny_vllm_model_dir)
    with saved_model_sampler("vllm", tok, tiny_vllm_model_dir,
                             VLLMEngineConfig(gpu_memory_utilization=ENGINE_RAM, max_model_len=256),
                             dtype=auto_dtype) as backend:
        assert backend.name == "vllm"
        assert os.environ["VLLM_USE_FLASHINFER_SAMPLER"] == "0"  # the engine started with it off
        roll = backend.generate(["Hi"], 2, max_new_tokens=4)
        assert roll.logprobs.shape == roll.completion_ids.shape
        backend.sleep()
        with pytest.raises(TypeError, match="VLLMSampler samples the saved model"):
            backend.sync(None)
    assert backend.llm is None
    backend.close()
    with pytest.raises(RuntimeError, match="is closed"):
        backend.generate(["Hi"], 1, max_new_tokens=2)



@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_an_in_process_engine_samples_follow_the_calls_seeds(tiny_vllm_model_dir):
    """A call's samples depend on its seeds, not on what the engine sampled before (what makes a
    resumed run sample as the uninterrupted one did); the caller's torch stream is untouched."""
    tok = load_tokenizer(tiny_vllm_model_dir)
    with saved_model_sampler("vllm", tok, tiny_vllm_model_dir,
                             VLLMEngineConfig(gpu_memory_utilization=ENGINE_RAM, max_model_len=256)) as backend:
        assert backend.seeds_calls
        sample = dict(max_new_tokens=8, temperature=1.0)
        first = backend.generate(["abc", "de"], 2, seeds=[11, 12, 13, 14], **sample).texts
        state = torch.get_rng_state()
        other = backend.generate(["abc", "de"], 2, seeds=[21, 22, 23, 24], **sample).texts
        assert torch.equal(torch.get_rng_state(), state)
        backend.generate(["xyz"], 3, **sample)  # unseeded: advances the engine's own stream
        again = backend.generate(["abc", "de"], 2, seeds=[11, 12, 13, 14], **sample).texts
    assert again == first
    assert other != first


def test_the_progress_bar_is_off_where_tqdm_is_disabled():
    """vLLM 0.32 divides by a disabled tqdm's elapsed time: ``TQDM_DISABLE=1`` turns the bar off."""
    from grpo.engine.sampler import shows_progress

    assert shows_progress(True, {}) and shows_progress(True, {"TQDM_DISABLE": ""})
    assert not shows_progress(True, {"TQDM_DISABLE": "1"}) and not shows_progress(True, {"TQDM_DISABLE": "0"})
    assert not shows_progress(False, {})
