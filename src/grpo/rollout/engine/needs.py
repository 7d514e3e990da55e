"""What a vLLM engine needs on CUDA, from the model's shapes and the params (no weights loaded), and
the train engine's weights form resolved for this machine (``form_here``).

An engine holds (``EnginePlan``): its weights and what else its weights form holds (the form's
``needs``: ``grpo.rollout.engine.forms.WeightsForm``; vLLM's LoRA buffers, a transient beside the
forward), the larger of its profile run's forward and sampler pass (``engine_profile_bytes``),
``ENGINE_NON_TORCH``, and the KV cache of one generation call, ``2 L k d b`` bytes per token for its
sequences x (``P + C``) tokens in ``ENGINE_BLOCK`` blocks. Its budget is ``gpu_memory_utilization
x`` the card. ``engine_needs`` is the train engine's plan in a given form; ``choose_engine_form``
resolves ``train.rollouts.engine_weights: auto`` by ``grpo.rollout.engine.forms.choose_form`` from the usable forms'
plans; ``form_here`` does that for the train stage on this machine, from the prepared model's
``config.json`` (``grpo.core.model_shapes.prepared_shapes``), the longest training prompt and this card.
``grpo check`` (``grpo.tools.memory``) prints the same plans; the saved-model engines' plans are there
(``grpo.tools.memory.saved_model_needs``). The vLLM lines of the constants and functions here:
docs/gpu-notes.md#engine-memory, #scheduler-bounds, #lora-loading and #sleep-and-wake-up.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from grpo.core.device import compute_dtype
from grpo.core.model_shapes import ModelShapes, prepared_name, prepared_shapes
from grpo.data.sources import build_prompt
from grpo.model.base_model import load_tokenizer
from grpo.rollout.engine import bounds
from grpo.rollout.engine.args import EngineRole, engine_args
from grpo.rollout.engine.forms import choose_form
from grpo.rollout.engine.forms_catalogue import usable_forms, weights_form

ENGINE_BLOCK = 16
"""Tokens per KV-cache block of vLLM on CUDA (``CacheConfig.DEFAULT_BLOCK_SIZE``)."""
SAMPLER_BYTES = 25
"""Bytes per (row, vocabulary) entry the sampler holds beside the logits: an fp32 copy (4), the
raw log-probs the engine returns (4), top-k/top-p's sorted fp32 values, their int64 order, the
sorted probabilities and a bool mask (4 + 8 + 4 + 1)."""
ENGINE_NON_TORCH = 256 * 2**20
"""Allowance for what the engine adds outside PyTorch's allocator (libraries' workspaces and
handles), counted into its non-KV memory and outside vLLM's sleep
pool, so it stays while the engine sleeps. Never measured."""


def kv_bytes_per_token(shapes: ModelShapes, b: int) -> int:
    """``2 x L x k x d x b``: keys and values of one token in every layer."""
    return bounds.kv_cache_bytes(shapes.layers, shapes.kv_heads, shapes.head_dim, 1, 1, b)


def engine_seq_tokens(prompt: int, new_tokens: int, max_model_len: int) -> int:
    """KV positions of one sequence of ``prompt + new_tokens`` (at most ``max_model_len``) in whole
    ``ENGINE_BLOCK`` blocks."""
    return math.ceil(min(prompt + new_tokens, max_model_len) / ENGINE_BLOCK) * ENGINE_BLOCK


def engine_step_tokens(seqs: int, prompt: int, new_tokens: int, max_model_len: int) -> int:
    """KV positions the engine holds for one generation call: ``seqs`` sequences (no prefix shared:
    the worst case), and at least one ``max_model_len`` sequence, which vLLM requires at start."""
    return max(seqs * engine_seq_tokens(prompt, new_tokens, max_model_len),
               engine_seq_tokens(max_model_len, 0, max_model_len))


def engine_profile_bytes(shapes: ModelShapes, tokens: int, seqs: int, b: int) -> tuple[int, int]:
    """(forward, sampler): the transient peaks of vLLM's profile run, which the engine keeps free
    beside its weights and KV cache (``enforce_eager``: no CUDA graphs). The forward of ``tokens``
    (``max_num_batched_tokens``) peaks in the MLP: the hidden state and residual (``2 H``), the fused gate/up output
    (``2 I``) and its activation (``I``) per token, ``b`` bytes each. Then the sampler on one row per
    sequence (``seqs`` = ``max_num_seqs``) with the hidden states
    still held: the logits in ``b`` bytes plus ``SAMPLER_BYTES`` per (row, vocabulary) entry. The two
    run one after the other."""
    h, i = shapes.hidden, shapes.intermediate
    forward = tokens * (2 * h + 3 * i) * b
    sampler = tokens * h * b + seqs * shapes.vocab * (b + SAMPLER_BYTES)
    return forward, sampler


@dataclass(frozen=True)
class EnginePlan:
    """An engine's memory on CUDA: what it needs, in one weight form, and its budget (the train
    engine: ``engine_needs``; SENT's and the evaluations': ``grpo.tools.memory.saved_model_needs``)."""

    form: str  # the weights form's name
    why: str  # how the form was chosen (train); the call it is bounded to (sent, evaluate)
    dtype: str
    b: int
    seqs: int  # max_num_seqs
    batched_tokens: int  # max_num_batched_tokens
    seq_tokens: int  # KV positions of one sequence (engine_seq_tokens)
    step_tokens: int  # KV positions of one generation call (engine_step_tokens)
    kv_per_token: int
    weights: int
    lora_rank: int  # lora.rank
    lora: int  # vLLM's LoRA buffers (a form whose engine has LoRA)
    forward: int
    sampler: int
    utilization: float
    card: int | None  # bytes of the card, None where unknown
    dequant: int = 0  # the form's transient beside the forward (nf4: the largest 4-bit layer dequantised)
    section: str = "train.rollouts"  # where its gpu_memory_utilization and max_model_len are (a section or a part)
    max_model_len: int = 0  # that section's: the longest sequence, which vLLM needs KV room for at start
    weights_how: str = ""  # how the form counts its weights (grpo check's line)
    dequant_how: str = ""  # what the transient is

    @property
    def profile(self) -> int:
        return max(self.forward + self.dequant, self.sampler)

    @property
    def fixed(self) -> int:
        """Everything but the KV cache."""
        return self.weights + self.lora + self.profile + ENGINE_NON_TORCH

    @property
    def kv_step(self) -> int:
        return self.step_tokens * self.kv_per_token

    @property
    def need(self) -> int:
        return self.fixed + self.kv_step

    @property
    def budget(self) -> int | None:
        """``gpu_memory_utilization x card``, all of which the engine
        holds while awake: what its weights and overhead leave becomes KV cache."""
        return None if self.card is None else math.ceil(self.card * self.utilization)


def engine_needs(params, shapes: ModelShapes, device: str, prompt_tokens: int, form: str,
                 card: int | None = None, why: str = "") -> EnginePlan:
    """The ``EnginePlan`` of the train engine holding the base in ``form``: the arguments the train
    stage would start it with (``grpo.rollout.engine.args.engine_args`` over ``grpo.rollout.engine.bounds.step_limits``,
    the form's LoRA rank), the form's own needs; one step's tokens: ``prompt_tokens +
    train.rollouts.max_new_tokens`` per completion of the largest call."""
    train, kind = params.train, weights_form(form)
    dtype = compute_dtype(params.model.dtype, device)
    b, name = dtype.itemsize, str(dtype).removeprefix("torch.")
    args = engine_args(params.model.path, train.rollouts, device=device, seed=train.seed, dtype=str(dtype), enforce_eager=True,
                       bounds=bounds.Bounds(*bounds.step_limits(train, train.distribution.num_processes)),
                       role=EngineRole(train.distribution.num_processes, kind.engine_lora(params.lora.rank)))
    seqs, tokens = args["max_num_seqs"], args["max_num_batched_tokens"]
    forward, sampler = engine_profile_bytes(shapes, tokens, seqs, b)
    own = kind.needs(shapes, params.lora.rank, b, name)
    return EnginePlan(
        form=form, why=why, dtype=name, b=b, seqs=seqs, batched_tokens=tokens,
        seq_tokens=engine_seq_tokens(prompt_tokens, train.rollouts.max_new_tokens, train.rollouts.max_model_len),
        step_tokens=engine_step_tokens(seqs, prompt_tokens, train.rollouts.max_new_tokens, train.rollouts.max_model_len),
        kv_per_token=kv_bytes_per_token(shapes, b), weights=own.weights, lora_rank=params.lora.rank, lora=own.lora,
        forward=forward, sampler=sampler, utilization=args["gpu_memory_utilization"], card=card,
        dequant=own.dequant, max_model_len=train.rollouts.max_model_len, weights_how=own.weights_how,
        dequant_how=own.dequant_how)


def decided_by_needs(params, device: str) -> bool:
    """Whether ``train.rollouts.engine_weights`` is resolved from the forms' needs: ``auto`` on CUDA with more
    than one form usable (elsewhere no shapes, prompt or card are looked up)."""
    return params.train.rollouts.engine_weights == "auto" and device.startswith("cuda") and len(usable_forms(params)[0]) > 1


def choose_engine_form(params, shapes: ModelShapes | None, device: str, prompt_tokens: int,
                       card: int | None) -> tuple[str, str]:
    """``train.rollouts.engine_weights`` resolved by ``grpo.rollout.engine.forms.choose_form`` from the usable forms'
    needs (``engine_needs``; computed only where ``decided_by_needs``)."""
    train = params.train
    usable, left_out = usable_forms(params)
    if not decided_by_needs(params, device):
        return choose_form(train.rollouts.engine_weights, device, [(name, None) for name in usable], None,
                           train.rollouts.gpu_memory_utilization, left_out)
    plans = [engine_needs(params, shapes, device, prompt_tokens, name, card) for name in usable]
    return choose_form("auto", device, [(p.form, p.need) for p in plans], plans[0].budget,
                       train.rollouts.gpu_memory_utilization, left_out)


def engine_plan(params, shapes: ModelShapes, device: str, prompt_tokens: int, card: int | None) -> EnginePlan:
    """The ``EnginePlan`` in the form ``choose_engine_form`` chooses."""
    form, why = choose_engine_form(params, shapes, device, prompt_tokens, card)
    return engine_needs(params, shapes, device, prompt_tokens, form, card, why)


def other_plans(params, shapes: ModelShapes, device: str, prompt_tokens: int, plan: EnginePlan) -> list[EnginePlan]:
    """The train engine in each other weights form usable with ``params``, in registration order, on
    ``plan``'s card: ``grpo check``'s advice where ``plan``'s form does not fit (``grpo.tools.memory.verdict``)."""
    return [engine_needs(params, shapes, device, prompt_tokens, name, plan.card)
            for name in usable_forms(params)[0] if name != plan.form]


def form_here(params, root: Path, device: str) -> tuple[str, str]:
    """``choose_engine_form`` for the train stage on this machine: the shapes of the prepared model
    (``model.path``'s ``config.json`` in the workspace ``root``), the longest training prompt (else
    ``max_model_len - max_new_tokens``) and, on CUDA, this card's total memory (none of it looked
    up where ``decided_by_needs`` is false)."""
    if not decided_by_needs(params, device):
        return choose_engine_form(params, None, device, 0, None)
    shapes = prepared_shapes(root / params.model.path)
    found = longest_prompt_tokens(params, root, (params.train.data_path,), provenance=False)  # the stage's own rows
    prompt = found[0] if found else max(params.train.rollouts.max_model_len - params.train.rollouts.max_new_tokens, 1)
    import torch

    card = torch.cuda.mem_get_info(torch.device(device))[1]
    return choose_engine_form(params, shapes, device, prompt, card)


def _prepared_source(data_dir: Path) -> str | None:
    """The ``data.source`` prepare_data wrote ``data_dir`` from (its ``stats.json``), or None."""
    try:
        return json.loads((data_dir / "stats.json").read_text()).get("source")
    except (OSError, ValueError, AttributeError):
        return None


def longest_prompt_tokens(params, root: Path, paths: tuple[str, ...] | None = None, *,
                          provenance: bool = True) -> tuple[int, str] | None:
    """Tokens of the longest training prompt (chat template and system prompt included), or of the
    first of ``paths`` found (``evaluate.test_path``: the evaluations'), when the
    rows and the model's tokenizer are in the workspace and were prepared for these params
    (``model.path`` holds ``model.name``, ``data.out_dir/stats.json`` names ``data.source``: a preset
    checked where the default pipeline ran is not measured with another model's tokenizer on
    another data set; ``provenance`` False skips that check: the train stage, whose rows DVC made
    for its params, reads only the ``train`` and ``model`` sections)."""
    tok_dir = root / params.model.path
    paths = paths or (params.train.data_path, params.sent.data_path)
    rows_path = next((root / p for p in paths if (root / p).is_file()), None)
    if rows_path is None or not (tok_dir / "tokenizer_config.json").is_file():
        return None
    if provenance and (prepared_name(tok_dir) not in (None, params.model.name) or
                       _prepared_source(root / params.data.out_dir) not in (None, params.data.source)):
        return None
    tok = load_tokenizer(tok_dir)
    questions = [json.loads(line)["question"] for line in rows_path.read_text().splitlines() if line.strip()]
    if not questions:
        return None
    longest = max(len(tok(build_prompt(tok, q, params.train.system_prompt), add_special_tokens=False)["input_ids"])
                  for q in questions)
    return longest, f"the longest prompt of {rows_path}"
