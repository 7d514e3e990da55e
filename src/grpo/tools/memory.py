"""Peak memory of one GRPO step, estimated from the model's shapes and the params (no weights loaded).

The model's modules are built on PyTorch's ``meta`` device from its ``config.json`` (no storage),
so every ``nn.Linear`` shape, the embeddings and which layers bitsandbytes quantises are counted
exactly as ``from_pretrained`` would build them (``grpo.core.model_shapes.model_shapes``; the config of
a model not prepared yet from ``grpo.tools.synthetic``'s named architectures: ``resolve_config``). Sizes below: ``H`` hidden,
``I`` intermediate, ``L`` layers, ``a`` attention heads, ``k`` KV heads, ``d`` head dim, ``V``
vocabulary, ``r`` LoRA rank, ``b`` bytes of the compute dtype (2 for bf16, 4 for fp32), ``P``
prompt tokens, ``C`` = ``train.rollouts.max_new_tokens`` (every completion full length: the worst case).

Resident in both phases:

* weights: NF4 ``n/2`` bytes per quantised weight plus its constants (one uint8 absmax per 64
  weights, one fp32 absmax per 256 of those, a 16-entry and a 256-entry fp32 code table and an
  fp32 offset per layer: about 0.516 byte/param), every other parameter (embeddings, untied LM
  head, norms, biases) in ``b`` bytes; ``quantization: none``: every parameter in ``b`` bytes;
* LoRA: ``r * (in + out)`` per targeted linear, fp32 parameter + gradient + two AdamW moments
  (16 bytes per parameter; the gradient is freed between steps, so generation holds 4 less).

Generation phase (the policy samples its rollouts; ``rows_gen`` = ``generation_batch_size``
rounded to whole groups, or the whole step, ``prompts_per_step * G``):

* KV cache: ``L * 2 * k * d * (P + C) * rows_gen * b`` (``transformers.DynamicCache``);
* sampling: ``rows_gen * V * (b + 8 + 4 [b = 2])`` (the step's logits, their fp32 copy, softmax
  and CDF), ``+ 13`` per entry with ``top_p < 1`` (sorted probabilities, int64 order, mask);
* the dense copies of the 4-bit layers that decoding uses (``grpo.model.nf4_layers.dequantized_weights``),
  ``n * b`` for every quantised weight plus another for each one a LoRA adapter wraps: a term of its
  own, always taken on a CPU; on CUDA the decode loop takes them where they fit the free memory
  (``grpo.rollout.rollout_backends.dense_decode``), so ``verdict`` also tries the step without them (4-bit
  decoding, slower) before it says the step does not fit;
* with the decode step compiled (``decode.*`` on CUDA; ``_compiled_step_terms``), instead of the
  KV cache: the compiled step's buffers, which stay through the update (its ``StaticCache`` for the
  call padded to its shape, int64 mask, CUDA graph pool: ``grpo.rollout.decode_memory.compiled_step_bytes``),
  and the prompts' cache while the prefill copies it in; validation's calls run on the same step,
  and the dense copies stay too (``both``).

SENT's and the evaluations' calls on the decode loop (no vLLM): ``decode_call`` (the dense model,
the split ``TransformersBackend`` makes under the card's budget, ``grpo.rollout.decode_memory.call_bytes``),
``decode_call_verdict`` its line.

Training phase, per micro-batch of ``n`` rows (``prompts_per_step * G / micro_batches``, rounded up
to whole groups as the trainer slices them), with ``T = P + C``:

* activations that autograd saves, per decoder layer and query token (bytes):
  ``2 (4H + 4)`` (two RMSNorms keep an fp32 copy of their input and its rsqrt)
  ``+ 2 a d b + 4a`` (query and attention output, fp32 log-sum-exp)
  ``+ 3 I b`` (MLP: gate output, its SiLU and the up output)
  ``+ 4 r`` per targeted linear (the LoRA A output) plus the LoRA inputs: an fp32 copy of the
  input per targeted linear when the compute dtype is bf16 (peft casts to the fp32 adapter), once
  per shared input in fp32 (the q/k/v input, the gate/up input, down's input; o's input is the
  attention output, already counted), with dropout ``(4 + m) * in`` per targeted linear (fp32
  output and the mask: ``m`` = 1 byte on CUDA, 4 on the CPU);
  per key position of each row: ``2 a d b`` (keys and values repeated to all heads for SDPA with
  a padding mask; ``2 k d b`` without one) and ``b`` per (query, key) pair for the mask.
  One pass over ``n`` rows of ``T`` tokens; with ``shared_prompt_forward`` (and no gradient
  checkpointing) a pass over the ``n / G`` prompts (``P`` tokens) and one over the ``n``
  completions (``C - 1`` query tokens on ``P + C - 1`` key positions); with ``forward_layout``
  packing the groups (``grpo.algorithm.logprobs.packed_hidden``) one pass over ``n / G`` sequences of
  ``S = P + G (C - 1)`` tokens (every completion at full length: the worst case), plus the
  ``S^2 b`` block mask of each. With gradient checkpointing:
  ``L * T * H * b`` per row (each layer's input) ``+ (4H + 4)`` per token (the final norm);
* the completion hidden states: ``n * T * H * b`` (``n * C * H * b`` with shared prompts; packed,
  the sequences' states and the rows gathered from them, ``(n / G * S + n * C) * H * b``);
* the largest of three working sets that are live one after another, never together (traced on
  fake CUDA tensors by ``bench/cuda_memory.py``: the body's backward starts after the LM head's has
  freed its tensors):

  - the chunked no-grad entropy/log-prob pass: ``min(logprob_chunk, n C) * V`` times ``b``
    (Triton: the logits only) or ``b + 4 + 4 [b = 2]`` (PyTorch: logits, an fp32 copy, the
    probabilities);
  - the LM head with grad at the kept tokens, ``K = entropy_top_quantile * n * C`` rows, chunked
    like the pass above (``grpo.algorithm.logprobs.selected_logprobs``): ``min(logprob_chunk, K) * V`` times
    ``b`` (Triton: the logits, overwritten by their gradient) or ``4 + b [b = 2]`` (PyTorch: the
    logits and one fp32 copy; fp32 logits are worked on in place), plus ``2 K H b`` (the kept
    hidden rows and their gradient direction, saved for backward);
  - the body's backward working set: one layer's activations (recomputed under checkpointing,
    its gradients otherwise) and ``5 I b`` per token of the larger pass (``MLP_BACKWARD``: at the
    peak of the layer's backward the trace finds eight intermediate-sized tensors live, three of
    them the saved ones counted above: the product the down projection's 4-bit matmul keeps, the
    gradients of its input and of the gate and up outputs, and the gate's sigmoid).

Attention is transformers' SDPA with a padding mask on CUDA (GRPO batches are ragged: prompts of
several lengths, completions that end early) and eager attention on CPUs
(``grpo.core.device.attention_implementation``): it saves the fp32 softmax output and its 16-bit cast
per (query, key) pair (``pair_bytes``) instead of SDPA's mask and log-sum-exp. The estimate is for the first, largest
micro-batch.

With engine rollouts on CUDA (``engine`` given to ``estimate``) the generation phase holds, instead of
the decode loop's KV cache and logits, the vLLM engine's whole budget, ``gpu_memory_utilization x``
the card (its needs where the card is unknown), and the training phase what the sleeping engine
keeps (``ENGINE_NON_TORCH``). What the engine needs (``grpo.rollout.engine.needs.engine_needs``): what its
weights form holds (the form's ``needs``: dense ``b`` bytes a parameter; the nf4 form's norms alone
plus vLLM's LoRA buffers, its 4-bit layers, embedding and head being the trainer's), the larger of
its profile run's forward and sampler pass, ``ENGINE_NON_TORCH``, and the KV cache of one call,
``2 L k d b`` bytes per token for its completions x (``P + C``) tokens in ``ENGINE_BLOCK`` blocks.
``grpo.rollout.engine.needs.choose_engine_form`` (``grpo.rollout.engine.forms.choose_form``) picks the form for
``train.rollouts.engine_weights: auto``; ``verdict`` says whether the step fits a card and which param to turn.

The saved-model engines of SENT (the base) and the evaluations (the policy exported dense) are
estimated the same way (``saved_model_needs``): dense weights in the stage's engine dtype, the
profile run at vLLM's default ``max_num_batched_tokens`` (``default_batched_tokens``: the stages
set none) and ``max_num_seqs`` = one call's sequences (``grpo.rollout.engine.bounds.saved_model_seqs``),
``ENGINE_NON_TORCH``, and the KV cache of one call, within the stage's ``gpu_memory_utilization x``
the card; ``saved_model_verdict`` says whether it fits, one line a stage.

Peak = the larger phase total (generation memory is released before training). The no-grad
passes (the reference's with ``beta > 0`` or a token-entropy rule's KL, the step-wide threshold
with several micro-batches) hold less than the training pass, so none is counted. CUDA's allocator slack, the CUDA context and, on the CPU, the process's
libraries come on top (``max_memory_allocated`` is the comparable GPU figure).

The exact parts are tested against real objects on the CPU (``tests/test_memory.py``): the LoRA
parameter count against peft's trainable parameters, the NF4 bytes against a bitsandbytes
model's storage, the KV cache against a ``DynamicCache``, the saved activations against autograd's
saved tensors.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from grpo.algorithm.entropy import build_token_rule
from grpo.algorithm.logprobs import packed_layout
from grpo.config.sections.lora import LoraConfig
from grpo.core.architectures import architecture_for_model
from grpo.core.device import attention_implementation, compute_dtype, sampling_dtype
from grpo.core.model_shapes import Linear, ModelShapes, decoder_linears, model_shapes, prepared_name
from grpo.core.model_shapes import count as _n
from grpo.rollout.decode_memory import LOGPROB_ROWS, CallSize, call_bytes, compiled_step_bytes, shapes_dims, split_call
from grpo.rollout.engine import bounds
from grpo.rollout.engine.args import engine_args, engine_lora_rank
from grpo.rollout.engine.bounds import largest_call
from grpo.rollout.engine.dense_form import DenseForm
from grpo.rollout.engine.needs import (
    ENGINE_BLOCK,
    ENGINE_NON_TORCH,
    SAMPLER_BYTES,
    EnginePlan,
    engine_profile_bytes,
    engine_seq_tokens,
    engine_step_tokens,
    kv_bytes_per_token,
)
from grpo.rollout.rollout_backends import planned_tokens
from grpo.rollout.sampling import plan_decode
from grpo.tools.synthetic import architecture_config
from grpo.training.passes import micro_slices

NF4_BLOCK = 64  # weights per absmax (bitsandbytes' default blocksize for 4-bit)
NESTED_BLOCK = 256  # absmaxes per fp32 absmax under double quantisation
NF4_LAYER_CONSTANTS = 16 * 4 + 256 * 4 + 4  # NF4 code table, nested code table, offset (fp32 each)
MLP_BACKWARD = 5  # intermediate-sized tensors of a layer's MLP backward beyond the saved activations (x b per token)
LORA_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


def resolve_config(model_cfg, root: Path):
    """``(transformers config, where it came from)`` of the configured model, or a one-line reason
    why it is unknown.

    In order: ``model.path/config.json`` (read from the workspace ``root``) when that directory
    holds ``model.name`` (the ``manifest.json`` prepare_model writes names it; a directory without
    one is taken as it is), ``model.name`` when it is a local directory with a ``config.json``,
    then a named architecture of ``grpo.tools.synthetic`` whose hub model ``model.name`` names (e.g.
    DeepSeek-R1-Distill-Qwen-1.5B -> ``qwen2-1.5b``). So a preset checked in a workspace where
    another model was prepared (``grpo check --params presets/seed003.yaml`` after the default
    pipeline) is estimated for the preset's model.
    """
    from transformers import AutoConfig

    path = root / model_cfg.path
    other = prepared_name(path)
    if other is not None and other == model_cfg.name:
        other = None
    for where in (path, root / model_cfg.name):
        if (where / "config.json").is_file() and not (where == path and other is not None):
            return AutoConfig.from_pretrained(where), f"{where / 'config.json'}"
    arch = architecture_for_model(model_cfg.name)
    if arch is not None:
        why = f"{model_cfg.path} holds {other}" if other is not None else f"{model_cfg.path} not prepared yet"
        return architecture_config(arch), f"grpo.tools.synthetic architecture {arch!r} (model.name {model_cfg.name}; {why})"
    if other is not None:
        return (f"the estimate needs {model_cfg.name!r}'s config.json: {path} holds {other!r} (prepared for other "
                f"params) and {model_cfg.name!r} is not an architecture known to grpo.tools.synthetic")
    return (f"the estimate needs the model's config.json: {root / model_cfg.path} does not exist yet and "
            f"{model_cfg.name!r} is not an architecture known to grpo.tools.synthetic (run prepare_model first)")


def resolve_shapes(model_cfg, root: Path) -> ModelShapes | str:
    """The shapes of the configured model (``resolve_config``), or a one-line reason why they are unknown."""
    found = resolve_config(model_cfg, root)
    return found if isinstance(found, str) else model_shapes(*found)


# ------------------------------------------------------------------------------------- the parts
def nf4_layer_bytes(n: int) -> int:
    """Bytes bitsandbytes stores for one NF4 weight of ``n`` entries (double quantisation)."""
    blocks = math.ceil(n / NF4_BLOCK)
    return math.ceil(n / 2) + blocks + 4 * math.ceil(blocks / NESTED_BLOCK) + NF4_LAYER_CONSTANTS


def weight_bytes(shapes: ModelShapes, quantization: str, b: int) -> int:
    """The frozen base: NF4 linears + the rest in ``b`` bytes, or everything in ``b`` bytes."""
    if quantization != "nf4":
        return shapes.total_params * b
    return sum(nf4_layer_bytes(x.params) for x in shapes.linears if x.quantized) + shapes.other_params * b


def lora_targets(shapes: ModelShapes, targets: list[str]) -> list[Linear]:
    return [x for x in shapes.linears if x.leaf in set(targets)]


def lora_params(shapes: ModelShapes, rank: int, targets: list[str]) -> int:
    """Trainable LoRA parameters: ``r * (in + out)`` per targeted linear."""
    return sum(rank * (x.in_features + x.out_features) for x in lora_targets(shapes, targets))


def kv_cache_bytes(shapes: ModelShapes, rows: int, positions: int, b: int) -> int:
    """``L * 2 * k * d * positions * rows * b``: keys and values of every layer."""
    return bounds.kv_cache_bytes(shapes.layers, shapes.kv_heads, shapes.head_dim, rows, positions, b)


def dropout_mask_bytes(device: str) -> int:
    """Bytes per entry of the mask LoRA dropout saves: CUDA's fused dropout keeps a bool mask, the
    CPU's keeps the scaled noise in the (fp32) adapter dtype."""
    return 1 if device == "cuda" else 4


def _lora_input_bytes(shapes: ModelShapes, targets: set[str], b: int, dropout: float, mask: int) -> int:
    """Per token and layer: the inputs the LoRA A matrices save (see the module docstring)."""
    dims = {x.leaf: x.in_features for x in shapes.layer_linears()}
    total = 0
    for group in LORA_GROUPS:
        hit = [m for m in group if m in targets and m in dims]
        if not hit:
            continue
        if dropout > 0:
            total += sum((4 + mask) * dims[m] for m in hit)
        elif b != 4:
            total += sum(4 * dims[m] for m in hit)
        elif group != ("o_proj",):  # fp32: one shared input, saved once (o's is the attention output)
            total += 4 * dims[hit[0]]
    return total


def _layer_targets(shapes: ModelShapes, targets: list[str]) -> set[str]:
    return {x.leaf for x in shapes.layer_linears()} & set(targets)


def layer_token_bytes(shapes: ModelShapes, b: int, lora_rank: int, targets: list[str], dropout: float,
                      device: str = "cuda") -> int:
    """Bytes autograd saves per decoder layer and query token (without the key/value and mask terms)."""
    h, a, d = shapes.hidden, shapes.heads, shapes.head_dim
    hit = _layer_targets(shapes, targets)
    lse = 4 * a if attention_implementation(device) == "sdpa" else 0  # SDPA's fp32 log-sum-exp
    return (2 * (4 * h + 4) + 2 * a * d * b + lse + 3 * shapes.intermediate * b
            + 4 * lora_rank * len(hit) + _lora_input_bytes(shapes, hit, b, dropout, dropout_mask_bytes(device)))


def pair_bytes(shapes: ModelShapes, b: int, padded: bool, device: str) -> int:
    """Bytes saved per (query, key) pair of a row: SDPA's padding mask (``b``; none unpadded), or
    eager attention's softmax output, which transformers takes in fp32, and its cast to ``b`` for
    the product with the values (``4 a``, ``(4 + b) a`` when ``b`` < 4)."""
    if attention_implementation(device) == "eager":
        return shapes.heads * (4 + (b if b != 4 else 0))
    return b if padded else 0


def _pass_bytes(shapes, per_token, rows, q_len, kv_len, b, padded, device) -> int:
    kv = 2 * (shapes.heads if padded else shapes.kv_heads) * shapes.head_dim * b
    return rows * (q_len * per_token + kv_len * kv + q_len * kv_len * pair_bytes(shapes, b, padded, device))


@dataclass(frozen=True)
class ForwardShape:
    """One forward pass with grad: ``rows`` sequences of ``prompt`` + ``completion`` tokens in groups
    of ``group``; ``shared``: a group's prompt runs once (its completions on the shared cache);
    ``padded``: the rows carry a padding mask."""

    rows: int
    prompt: int
    completion: int
    group: int = 1
    shared: bool = False
    padded: bool = True


def activation_bytes(shapes: ModelShapes, lora: LoraConfig, call: ForwardShape, *, b: int, checkpointing: bool,
                     device: str = "cuda") -> tuple[int, int]:
    """(saved by the forward, one layer's share for the backward working set) in bytes, for the
    policy of ``lora`` (``grpo.config.sections.lora.LoraConfig``: rank, targets, dropout) over ``call``.

    Without checkpointing the first layer's input (the frozen embeddings' output) needs no
    gradient, so its q/k/v dropout saves no mask; its first norm saves nothing either, which the
    final norm makes up for."""
    rows, prompt, completion, group, shared, padded = (call.rows, call.prompt, call.completion, call.group,
                                                       call.shared, call.padded)
    targets, dropout = lora.target_modules, lora.dropout
    per_token = layer_token_bytes(shapes, b, lora.rank, targets, dropout, device)
    t = prompt + completion
    one_layer = _pass_bytes(shapes, per_token, rows, t, t, b, padded, device)
    if checkpointing:
        return rows * t * (shapes.layers * shapes.hidden * b + 4 * shapes.hidden + 4), one_layer
    tokens = rows * t
    if shared and group > 1 and rows % group == 0 and completion > 1:
        one_layer = (_pass_bytes(shapes, per_token, rows // group, prompt, prompt, b, padded, device)
                     + _pass_bytes(shapes, per_token, rows, completion - 1, t - 1, b, padded, device))
        tokens = rows // group * prompt + rows * (completion - 1)
    first_masks = 0
    if dropout > 0:
        qkv = [m for m in LORA_GROUPS[0] if m in _layer_targets(shapes, targets)]
        first_masks = tokens * dropout_mask_bytes(device) * shapes.hidden * len(qkv)
    return shapes.layers * one_layer - first_masks, one_layer


def micro_batch_rows(n: int, micro_batches: int, group: int) -> int:
    """Rows of the first (largest) micro-batch of the update (``grpo.training.passes.micro_slices``)."""
    first = micro_slices(n, micro_batches, group)[0]
    return first.stop - first.start


# ------------------------------------------------------------------------------------- the engine
CUDA_CONTEXT = 768 * 2**20
"""Allowance for the memory a CUDA process holds outside torch's allocator (the context, cuBLAS's
workspace, kernels loaded after a forward): the H200 check's figure after a forward and a step,
rounded (docs/gpu-runs/2026-11-28-h200/, the `update` phase's ``outside_forward_gib``)."""


# ------------------------------------------------------------------------------------- saved models
SAVED_MODEL_STAGES = (("sent", ("sent",)), ("evaluate", ("baseline_eval", "final_eval")))
"""The params section of each saved-model engine and the stages that start one with it."""
BATCHED_TOKENS_CPU, BATCHED_TOKENS_CARD, BATCHED_TOKENS_LARGE_CARD = 4096, 8192, 16384
"""vLLM's default ``max_num_batched_tokens`` for its ``LLM`` class: on a CPU, on a card below
70 GiB, on one from 70 GiB (an A100 excepted)."""


def default_batched_tokens(device: str, card: int | None, seqs: int, max_model_len: int) -> int:
    """vLLM's ``max_num_batched_tokens`` where none is given (``EngineArgs.get_batch_defaults`` and
    ``_set_default_max_num_seqs_and_batched_tokens_args``; docs/gpu-notes.md#scheduler-bounds):
    ``BATCHED_TOKENS_CPU`` on a CPU, ``BATCHED_TOKENS_CARD`` on a card below 70 GiB or an unknown
    one, ``BATCHED_TOKENS_LARGE_CARD`` from 70 GiB (vLLM keeps an 80 GiB A100 at 8,192, which a
    size cannot tell: the larger figure is the worst case), capped at ``seqs x max_model_len``. vLLM
    raises it to ``max_model_len`` without chunked prefill, which it turns on for decoder models."""
    if device == "cpu":
        default = BATCHED_TOKENS_CPU
    else:
        default = BATCHED_TOKENS_LARGE_CARD if card is not None and card >= 70 * 2**30 else BATCHED_TOKENS_CARD
    return min(default, seqs * max_model_len)


def saved_model_dtype(params, section: str, device: str):
    """The torch dtype of ``section``'s engine, as its stage picks it: SENT
    ``grpo.core.device.sampling_dtype(sent.dtype)`` (tasks/sent.py), the evaluations the sampler's
    default ``auto`` (``grpo.evaluation.evaluate``: the compute dtype ``auto`` gives on ``device``)."""
    setting = sampling_dtype(params.sent.dtype, device) if section == "sent" else "auto"
    return compute_dtype(setting, device)


def saved_model_needs(params, shapes: ModelShapes, device: str, section: str, prompt_tokens: int,
                      card: int | None = None) -> EnginePlan:
    """The ``EnginePlan`` of the saved-model engine of ``section`` (``sent``: the base;
    ``evaluate``: the policy exported dense), started as ``grpo.rollout.engine.sampler.saved_model_sampler``
    starts it (``engine_args`` over ``grpo.rollout.engine.bounds.saved_model_bounds``): every parameter in
    the engine dtype, its profile run at vLLM's default ``max_num_batched_tokens``
    (``default_batched_tokens``) and ``max_num_seqs`` = one call's sequences, and the KV cache of
    that call, ``prompt_tokens + max_new_tokens`` a sequence (none shared: the worst case)."""
    cfg = getattr(params, section)
    dtype = saved_model_dtype(params, section, device)
    b = dtype.itemsize
    sent = section == "sent"
    args = engine_args(params.model.path, cfg, device=device, seed=cfg.seed if sent else 0, dtype=str(dtype),
                       bounds=bounds.saved_model_bounds(cfg), enforce_eager=cfg.enforce_eager if sent else True)
    seqs, length = args["max_num_seqs"], args["max_model_len"]
    tokens = args.get("max_num_batched_tokens") or default_batched_tokens(device, card, seqs, length)
    forward, sampler = engine_profile_bytes(shapes, tokens, seqs, b)
    calls = (f"{section}.batch_prompts {cfg.batch_prompts} x "
             + (f"num_samples {cfg.num_samples}" if sent else "1 greedy completion"))
    name = str(dtype).removeprefix("torch.")
    weights = DenseForm.needs(shapes, 0, b, name)  # a saved model's engine holds it as the dense form does
    return EnginePlan(
        form="dense", why=calls, dtype=name, b=b, seqs=seqs, batched_tokens=tokens,
        seq_tokens=engine_seq_tokens(prompt_tokens, cfg.max_new_tokens, length),
        step_tokens=engine_step_tokens(seqs, prompt_tokens, cfg.max_new_tokens, length),
        kv_per_token=kv_bytes_per_token(shapes, b), weights=weights.weights, lora_rank=0,
        lora=0, forward=forward, sampler=sampler, utilization=args["gpu_memory_utilization"], card=card,
        section=section, max_model_len=length, weights_how=weights.weights_how)


def saved_model_contexts(section: str) -> int:
    """CUDA contexts on the card when ``section``'s engine starts: the engine's process (vLLM's
    engine core on CUDA) and, for the evaluations, the stage's own, which exported the policy on
    the GPU (``grpo.model.lora_policy.export_dense`` gives the memory back, not the context)."""
    return 1 if section == "sent" else 2


def saved_model_verdict(params, shapes: ModelShapes, device: str, plan: EnginePlan, prompt_tokens: int) -> str:
    """Whether the saved-model engine ``plan`` fits its card: its budget
    (``gpu_memory_utilization x`` the card) free at its start beside ``saved_model_contexts`` CUDA
    contexts, and within it the KV room the weights and overhead leave holding one call's
    sequences at full length; if not, the one param to turn (``_saved_model_knob``). Below one
    ``max_model_len`` sequence of room the engine does not start; above it, vLLM keeps fewer of
    the call's sequences in flight than it was given (it queues or preempts the rest)."""
    card, s = plan.card, plan.section
    free = card - saved_model_contexts(s) * CUDA_CONTEXT
    head = f"card {gib(card)}:"
    room = plan.budget - plan.fixed
    call = f"{plan.seqs} sequences x {plan.seq_tokens} tokens = {plan.kv_step / plan.kv_per_token / 1e3:.1f} k tokens"
    if plan.budget > free:
        return (f"{head} does not fit: the engine's budget {gib(plan.budget)} ({s}.gpu_memory_utilization "
                f"{plan.utilization:g}) is not free at its start (card - {saved_model_contexts(s)} x CUDA context "
                f"{gib(CUDA_CONTEXT)} = {gib(free)}); turn {_saved_model_knob(params, shapes, device, plan, prompt_tokens, free)}")
    if plan.need > plan.budget:
        left = f"KV room {gib(room)} = {room / plan.kv_per_token / 1e3:.1f} k tokens" if room > 0 else "no KV room"
        what = ("the engine does not start" if room < engine_seq_tokens(plan.max_model_len, 0, plan.max_model_len)
                * plan.kv_per_token else "vLLM keeps fewer in flight")
        return (f"{head} does not fit: of {s}.gpu_memory_utilization {plan.utilization:g} x the card = "
                f"{gib(plan.budget)}, weights and overhead take {gib(plan.fixed)}: {left} < one call's {call} "
                f"({what}); turn {_saved_model_knob(params, shapes, device, plan, prompt_tokens, free)}")
    return (f"{head} fits: needs {gib(plan.need)} of {s}.gpu_memory_utilization {plan.utilization:g} = "
            f"{gib(plan.budget)}; KV room {room / plan.kv_per_token / 1e3:.1f} k tokens for one call's {call}")


def _saved_model_knob(params, shapes: ModelShapes, device: str, plan: EnginePlan, prompt_tokens: int,
                      free: int) -> str:
    """The one param that makes ``plan`` fit ``free`` bytes, first of: a ``gpu_memory_utilization``
    between its needs and ``free``; the most ``batch_prompts`` that fit at the current share, then at
    the largest free one; the decode loop."""
    card, s = plan.card, plan.section
    low, high = math.ceil(plan.need / card * 100) / 100, math.floor(free / card * 100) / 100
    if low <= high:
        return f"{s}.gpu_memory_utilization: between {low:.2f} and {high:.2f}"
    cfg = getattr(params, s)

    def most_prompts(share: float) -> int:
        for n in range(cfg.batch_prompts - 1, 0, -1):
            fewer = _with(params, {f"{s}.batch_prompts": n, f"{s}.gpu_memory_utilization": share})
            if saved_model_needs(fewer, shapes, device, s, prompt_tokens, card).need <= math.ceil(card * share):
                return n
        return 0

    shares = [u for u in dict.fromkeys((plan.utilization, high)) if 0 < u and math.ceil(card * u) <= free]
    found = [(u, n) for u in shares if (n := most_prompts(u))]
    if not found:
        return f"{s}.backend: transformers (the decode loop: no engine)"
    say = [f"at most {n}" + ("" if u == plan.utilization else f" with {s}.gpu_memory_utilization {u:.2f}")
           for u, n in found]
    return f"{s}.batch_prompts: {say[0]}" + (f" ({say[1]})" if len(say) > 1 and found[1][1] > found[0][1] else "")


# ------------------------------------------------------------------------------------- the table
@dataclass
class Term:
    name: str
    phase: str  # "both", "generate" or "train"
    bytes: int
    how: str = ""


@dataclass
class Estimate:
    device: str
    dtype: str
    prompt_tokens: int
    prompt_source: str
    shapes: ModelShapes
    terms: list[Term] = field(default_factory=list)

    def total(self, phase: str) -> int:
        return sum(t.bytes for t in self.terms if t.phase in ("both", phase))

    @property
    def peak(self) -> int:
        return max(self.total("generate"), self.total("train"))

    @property
    def peak_phase(self) -> str:
        return "generation" if self.total("generate") >= self.total("train") else "training"


def estimate(params, shapes: ModelShapes, device: str, prompt_tokens: int, prompt_source: str = "",
             engine: EnginePlan | None = None) -> Estimate:
    """The terms of one training step's memory for ``params`` on ``device`` (``cpu`` or ``cuda``):
    rollouts from the decode loop, or with ``engine`` from that vLLM engine, which holds its whole
    budget while awake (its needs where the card is unknown) and, asleep during the update, only
    what lies outside its pool."""
    model, lora = params.model, params.lora
    dtype = compute_dtype(model.dtype, device)
    b = dtype.itemsize
    dname = str(dtype).removeprefix("torch.")
    est = Estimate(device, dname, prompt_tokens, prompt_source, shapes)
    add = est.terms.append
    qn = shapes.quantized_params
    if model.quantization == "nf4":
        how = (f"NF4: {_n(qn)} params in 4 bits + constants ({weight_bytes(shapes, 'nf4', b) - shapes.other_params * b:,}"
               f" B), {_n(shapes.other_params)} more in {dname}")
    else:
        how = f"{_n(shapes.total_params)} params in {dname}"
    add(Term("weights", "both", weight_bytes(shapes, model.quantization, b), how))
    n_lora = lora_params(shapes, lora.rank, lora.target_modules)
    add(Term("LoRA + AdamW", "both", 16 * n_lora,
             f"{_n(n_lora)} params x 16 B (fp32 param, grad, 2 moments)"))

    if engine is not None:
        add(_engine_awake(engine))
        add(Term("vLLM engine, asleep", "train", ENGINE_NON_TORCH,
                 "sleep level 1: weights and runtime state offloaded to host memory, KV cache dropped "
                 "(docs/gpu-notes.md#sleep-and-wake-up); the non-torch allowance outside its pool stays"))
    else:
        _decode_loop_terms(est, shapes, params, device, prompt_tokens, b)
    _update_terms(est, shapes, params, device, prompt_tokens, b)
    return est


def _engine_awake(engine: EnginePlan) -> Term:
    if engine.budget is None:
        return Term("vLLM engine, awake", "generate", engine.need,
                    f"its needs ({engine.form}); it holds train.rollouts.gpu_memory_utilization {engine.utilization:g} x "
                    "the card: --gpu-memory GIB")
    return Term("vLLM engine, awake", "generate", engine.budget,
                f"train.rollouts.gpu_memory_utilization {engine.utilization:g} x {gib(engine.card)} ({engine.form}: "
                "weights, overhead, KV cache)")


DENSE_COPIES = "dense 4-bit copies (decode)"
"""The name of the term ``verdict`` may leave out on CUDA (the decode loop then stays 4-bit)."""


def _decode_loop_terms(est: Estimate, shapes: ModelShapes, params, device: str, p: int, b: int) -> None:
    """The generation phase's terms with rollouts from the decode loop on the policy."""
    model, lora, train = params.model, params.lora, params.train
    add, g, c = est.terms.append, train.rollouts.group_size, train.rollouts.max_new_tokens
    nf4, qn = model.quantization == "nf4", shapes.quantized_params
    rows_gen = largest_call(train.rollouts.prompts_per_step, g, train.rollouts.generation_batch_size)
    loop = plan_decode(params.decode, device, train.steps * c).loop
    kept = loop.compiled
    if kept:  # the compiled step's buffers stay for the next step's rollouts and validation's calls
        _compiled_step_terms(est, shapes, params, rows_gen, p, b, loop)
    else:
        add(Term("KV cache", "generate", kv_cache_bytes(shapes, rows_gen, p + c, b),
                 f"{shapes.layers} layers x 2 x {shapes.kv_heads} kv heads x {shapes.head_dim} x {p + c} positions x "
                 f"{rows_gen} rows x {b} B"))
    per_entry = b + 8 + (4 if b != 4 else 0) + (13 if train.rollouts.top_p < 1 else 0)
    add(Term("sampling logits", "generate", rows_gen * shapes.vocab * per_entry,
             f"{rows_gen} rows x {shapes.vocab} vocab x {per_entry} B"))
    if nf4:
        wrapped = sum(x.params for x in lora_targets(shapes, lora.target_modules) if x.quantized)
        add(Term(DENSE_COPIES, "both" if kept else "generate", (qn + wrapped) * b,
                 f"({_n(qn)} + {_n(wrapped)} LoRA-merged) params x {b} B"
                 + ("; kept through the update: the compiled decode step holds them (decode.compile_step)" if kept
                    else "")))


COMPILED_STEP = "compiled decode step (kept)"
"""The name of the term of a compiled decode step's buffers, which stay between calls."""


def _compiled_step_terms(est: Estimate, shapes: ModelShapes, params, rows: int, p: int, b: int, loop) -> None:
    """Training's rollouts on the compiled step of ``loop`` (its ``step_shape``: the static loop's
    prompts to a power of two, their length to ``decode.loop_options.static.length_bucket``): its ``StaticCache``, mask
    and CUDA graph pool (``grpo.rollout.decode_memory.compiled_step_bytes``) in both phases, and the prompts'
    own cache while the prefill copies it in. Validation's calls run on the same step
    (``grpo.rollout.decode_memory.split_call`` takes a held step first: as many prompts as its rows hold)."""
    train, g = params.train, params.train.rollouts.group_size
    c = train.rollouts.max_new_tokens
    prompts, length = loop.step_shape(rows // g, g, p, c)
    n, positions = prompts * g, length + c
    est.terms.append(Term(COMPILED_STEP, "both", compiled_step_bytes(shapes_dims(shapes, b), n, positions),
                          f"StaticCache {kv_cache_bytes(shapes, n, positions, b) / 2**20:.0f} MiB ({n} rows x "
                          f"{length}+{c} positions) + int64 mask + CUDA graph pool (logits, one layer's MLP); "
                          f"validation's calls run on it"))
    est.terms.append(Term("prompt cache (prefill)", "generate", kv_cache_bytes(shapes, prompts, length, b),
                          f"{prompts} prompts x {length} positions, while copied into the StaticCache"))


@dataclass(frozen=True)
class DecodeCall:
    """A saved model's largest decode-loop call on a card (SENT's, the evaluations'; ``decode_call``):
    the dense weights, the prompts one call takes under the card's budget, the call's shape on a
    compiled step (``None``: not compiled) and its working bytes (``grpo.rollout.decode_memory.call_bytes``)."""

    section: str
    dtype: str
    weights: int
    prompts: int  # the call's prompts: section.batch_prompts
    samples: int
    prompt_tokens: int
    new_tokens: int
    per_call: int  # prompts one decode call takes (the split)
    compiled: object  # grpo.rollout.decode_memory.CompiledCall | None
    working: int
    why: str  # the decode plan

    @property
    def need(self) -> int:
        return self.weights + self.working


def decode_call(params, shapes: ModelShapes, device: str, section: str, prompt_tokens: int, card: int | None,
                context: int = CUDA_CONTEXT, stage_prompts: int | None = None) -> DecodeCall:
    """The largest call of ``section``'s (``sent``, ``evaluate``) saved-model sampler on the decode
    loop (``grpo.rollout.engine.sampler.saved_model_sampler`` without vLLM: the model dense in the stage's
    dtype, log-probs on): ``batch_prompts`` x (``num_samples`` for SENT, 1 greedy for the
    evaluations) of ``prompt_tokens`` + ``max_new_tokens``, split as ``TransformersBackend`` splits
    its first call against the budget ``card - context - weights`` (``card`` None: not split), on a
    compiled step where ``decode.*`` compiles one for the stage's token steps (``stage_prompts``
    prompts; None: unknown, taken as enough)."""
    cfg = getattr(params, section)
    dtype = saved_model_dtype(params, section, device)
    b, d = dtype.itemsize, shapes_dims(shapes, dtype.itemsize)
    samples = cfg.num_samples if section == "sent" else 1
    weights = shapes.total_params * b
    planned = None if stage_prompts is None else planned_tokens(stage_prompts, cfg)
    plan = plan_decode(params.decode, device, planned)
    budget = None if card is None else card - context - weights
    call = CallSize(cfg.batch_prompts, samples, prompt_tokens, cfg.max_new_tokens)
    per_call, compiled = split_call(d, call, budget, LOGPROB_ROWS, plan.loop)
    working = call_bytes(d, per_call, samples, prompt_tokens, cfg.max_new_tokens, LOGPROB_ROWS, compiled)
    return DecodeCall(section, str(dtype).removeprefix("torch."), weights, cfg.batch_prompts, samples, prompt_tokens,
                      cfg.max_new_tokens, per_call, compiled, working, plan.why)


def decode_call_verdict(call: DecodeCall, card: int, context: int = CUDA_CONTEXT) -> str:
    """Whether ``call`` fits a card of ``card`` bytes beside ``context`` (one line for ``grpo check``)."""
    shape = "" if call.compiled is None else (f", padded to {call.compiled.prompts} prompts of "
                                              f"{call.compiled.prompt_len} tokens on the compiled step")
    head = (f"card {gib(card)}: the decode loop, {call.per_call} of {call.prompts} prompts a call x {call.samples} of "
            f"{call.prompt_tokens} + {call.new_tokens} tokens{shape}: weights {gib(call.weights)} + call "
            f"{gib(call.working)} = {gib(call.need)} + CUDA context {gib(context)} = {gib(call.need + context)}")
    return head + ("; fits" if call.need + context <= card else "; does not fit")


def forward_tokens(n: int, g: int, p: int, c: int, *, packed: bool, shared: bool) -> tuple[int, int]:
    """(tokens of the completion hidden states, tokens of the largest body pass) of one micro-batch
    of ``n`` rows in its layout: packed groups (``n / G`` sequences of ``P + G (C - 1)``, their states
    and the rows gathered from them), shared prompts (the prompts' pass or the completions' pass),
    or one pass over full rows."""
    if packed:
        seq_tokens = n // g * (p + g * (c - 1))
        return seq_tokens + n * c, seq_tokens
    hidden = n * c if shared and g > 1 else n * (p + c)
    if shared and g > 1 and n % g == 0 and c > 1:
        return hidden, max(n // g * p, n * (c - 1))
    return hidden, n * (p + c)


def _update_terms(est: Estimate, shapes: ModelShapes, params, device: str, p: int, b: int) -> None:
    """The training phase's terms (one micro-batch's forward and backward)."""
    model, lora, train = params.model, params.lora, params.train
    add, g, c = est.terms.append, train.rollouts.group_size, train.rollouts.max_new_tokens
    n = micro_batch_rows(train.rollouts.prompts_per_step * g, train.passes.micro_batches, g)
    gc_on = model.gradient_checkpointing
    packed = train.passes.shared_prompt_forward and g > 1 and n % g == 0 and packed_layout(train.passes.forward_layout, device)
    shared = train.passes.shared_prompt_forward and not gc_on and not packed
    seqs, seq_len = (n // g, p + g * (c - 1)) if packed else (n, p + c)  # a packed group: one sequence
    call = ForwardShape(seqs, seq_len if packed else p, 0 if packed else c, g, shared)
    saved, one_layer = activation_bytes(shapes, lora, call, b=b, checkpointing=gc_on, device=device)
    if packed:
        saved += seqs * seq_len * seq_len * b  # the additive block mask
    per_tok = layer_token_bytes(shapes, b, lora.rank, lora.target_modules, lora.dropout, device)
    if gc_on:
        how = f"checkpointed: {seqs} rows x {seq_len} tokens x {shapes.layers} layer inputs x {shapes.hidden} x {b} B"
    else:
        how = (f"{shapes.layers} layers x {per_tok:,} B/token + keys/values/mask, "
               + (f"{seqs} packed groups x {p}+{g}x{c - 1} tokens" if packed else f"{n} rows x {p}+{c} tokens")
               + (f", prompts shared by G={g}" if shared and g > 1 else ""))
    add(Term("activations", "train", saved, how))
    hidden_tokens, pass_tokens = forward_tokens(n, g, p, c, packed=packed, shared=shared)
    add(Term("completion hidden states", "train", hidden_tokens * shapes.hidden * b,
             f"{hidden_tokens} tokens x {shapes.hidden} x {b} B"))
    kernel = train.passes.kernel if train.passes.kernel != "auto" else ("triton" if device == "cuda" else "torch")
    chunk = min(train.passes.logprob_chunk, n * c)
    per_entry = b if kernel == "triton" else b + 4 + (4 if b != 4 else 0)
    q = build_token_rule(train.loss).grad_fraction()  # the valid tokens whose LM-head rows need grad
    kept = math.ceil(q * n * c)
    head_rows = min(train.passes.logprob_chunk, kept)
    head_entry = b if kernel == "triton" else 4 + (b if b != 4 else 0)
    # the no-grad chunk pass, the LM head with grad and the body's backward run one after the other
    # (traced: bench/cuda_memory.py): the largest of the three counts
    one_after_another = [
        Term("backward working set", "train", one_layer + MLP_BACKWARD * shapes.intermediate * b * pass_tokens,
             ("one layer recomputed" if gc_on else "one layer's gradients")
             + f" + {MLP_BACKWARD} x {pass_tokens} tokens x {shapes.intermediate} x {b} B (MLP backward)"),
        Term("entropy/log-prob pass", "train", chunk * shapes.vocab * per_entry,
             f"{chunk} rows x {shapes.vocab} x {per_entry} B ({kernel})"),
        Term("LM head with grad", "train", head_rows * shapes.vocab * head_entry + 2 * kept * shapes.hidden * b,
             f"{head_rows} of {kept} kept tokens x {shapes.vocab} x {head_entry} B ({kernel}) + 2 x {kept} x "
             f"{shapes.hidden} x {b} B"),
    ]
    largest = max(one_after_another, key=lambda t: t.bytes)
    others = ", ".join(f"{t.name} {gib(t.bytes)}" for t in one_after_another if t is not largest)
    add(Term(largest.name, "train", largest.bytes, f"{largest.how}; > {others} (one after another)"))


def gib(x: float) -> str:
    if x >= 2**30:
        return f"{x / 2**30:.2f} GiB"
    return f"{x / 2**20:.1f} MiB"


def format_table(est: Estimate) -> list[str]:
    """The estimate as text lines: one term a line, then the two phase totals and the peak."""
    width = max(len(t.name) for t in est.terms) + 2
    lines = [f"  {'term':<{width}}{'phase':<10}{'size':>11}  formula"]
    for t in est.terms:
        lines.append(f"  {t.name:<{width}}{t.phase:<10}{gib(t.bytes):>11}  {t.how}")
    gen, tr = est.total("generate"), est.total("train")
    lines.append(f"  {'generation total':<{width}}{'':<10}{gib(gen):>11}")
    lines.append(f"  {'training total':<{width}}{'':<10}{gib(tr):>11}")
    lines.append(f"  {'peak':<{width}}{'':<10}{gib(est.peak):>11}  ({est.peak_phase})")
    return lines


def format_engine(plan: EnginePlan, shapes: ModelShapes) -> list[str]:
    """The engine's arithmetic as text lines: its parts, what it needs, its budget and the KV room."""
    b, s = plan.b, shapes
    rows = [(f"weights ({plan.form})", plan.weights, plan.weights_how)]
    if plan.lora:
        n_lin = len(decoder_linears(s))
        rows.append(("LoRA buffers", plan.lora, f"max_lora_rank {engine_lora_rank(plan.lora_rank)} x (in + out) of "
                     f"{n_lin} decoder linears x {b} B, one adapter slot"))
    rows.append(("profile run", plan.profile,
                 f"the larger of its forward, max_num_batched_tokens {plan.batched_tokens} x (2 x {s.hidden} + 3 x "
                 f"{s.intermediate}) x {b} B = {gib(plan.forward)}"
                 f"{f' + {plan.dequant_how} {gib(plan.dequant)}' if plan.dequant else ''}, and its sampler pass, max_num_seqs {plan.seqs} x "
                 f"{s.vocab} x ({b} + {SAMPLER_BYTES}) B + the hidden states = {gib(plan.sampler)}"))
    rows.append(("non-torch (allowance)", ENGINE_NON_TORCH, "never measured"))
    tokens = (f"{plan.seqs} {'completions' if plan.section == 'train.rollouts' else 'sequences'} x {plan.seq_tokens}"
              if plan.step_tokens == plan.seqs * plan.seq_tokens
              else "one max_model_len sequence, vLLM's least")
    rows.append((f"KV cache of one {'step' if plan.section == 'train.rollouts' else 'call'}", plan.kv_step,
                 f"{plan.step_tokens:,} tokens ({tokens}, in blocks of {ENGINE_BLOCK}) x {plan.kv_per_token / 1024:g}"
                 f" KiB/token (2 x {s.layers} layers x {s.kv_heads} kv heads x {s.head_dim} x {b} B)"))
    rows.append(("needs", plan.need, "" if plan.card is None else
                 f"= gpu_memory_utilization {plan.need / plan.card:.3f} of the card"))
    if plan.budget is not None:
        room = plan.budget - plan.fixed
        left = f"{gib(room)} = {room / plan.kv_per_token / 1e3:.1f} k tokens" if room > 0 else "nothing"
        rows.append(("budget", plan.budget, f"{plan.section}.gpu_memory_utilization {plan.utilization:g} x "
                     f"{gib(plan.card)}; left for KV after weights and overhead: {left} (one "
                     f"{'step' if plan.section == 'train.rollouts' else 'call'}: {plan.step_tokens / 1e3:.1f} k)"))
    width = max(len(name) for name, _, _ in rows) + 2
    return [f"  {name:<{width}}{gib(size):>11}  {how}".rstrip() for name, size, how in rows]


def _engine_knob(plan: EnginePlan, others: Sequence[EnginePlan], free: int, card: int) -> str:
    """The one param that lets the engine fit ``free`` bytes beside the policy, first of: a
    ``gpu_memory_utilization`` between its needs and ``free``; another weights form (``others``:
    the usable ones' plans, in registration order), the first that needs less than this one and
    fits (the nf4 form for a dense engine); fewer completions per call (the KV cache of one call);
    no engine."""
    low, high = math.ceil(plan.need / card * 100) / 100, math.floor(free / card * 100) / 100
    if low <= high:
        return f"train.rollouts.gpu_memory_utilization: between {low:.2f} and {high:.2f}"
    leaner = next((o for o in others if o.form != plan.form and o.need < plan.need and o.need <= free), None)
    if leaner is not None:
        return f"train.rollouts.engine_weights: {leaner.form} (needs {gib(leaner.need)})"
    per_seq = plan.seq_tokens * plan.kv_per_token
    fits = min((free - plan.fixed) // per_seq, plan.seqs - 1) if free > plan.fixed else 0
    if fits >= 1:
        return f"train.rollouts.generation_batch_size: at most {fits} completions per call (the KV cache of one call)"
    return "train.rollouts.backend: transformers (the decode loop: no engine)"


def verdict(params, est: Estimate, card: int, plan: EnginePlan | None = None,
            others: Sequence[EnginePlan] = ()) -> str:
    """Whether the step fits a card of ``card`` bytes (the CUDA context allowance included) and, if
    not, the one knob to turn. ``plan``: the engine (None: decode-loop rollouts); ``others``: the
    engine in the other usable weights forms, for the advice when this one does not fit
    (``grpo.rollout.engine.needs.other_plans``). Checked in order:
    the engine's budget must be free when it starts beside the policy,
    hold its needs, then the update must fit."""
    resident = sum(t.bytes for t in est.terms if t.phase == "both")
    free = card - resident - CUDA_CONTEXT  # what the engine can get at its start
    head = f"card {gib(card)}:"
    if plan is not None and plan.budget > free:
        return (f"{head} does not fit: the engine's budget {gib(plan.budget)} is not free at its start (card - "
                f"policy {gib(resident)} - CUDA context {gib(CUDA_CONTEXT)} = {gib(free)}); turn "
                f"{_engine_knob(plan, others, free, card)}")
    if plan is not None and plan.budget < plan.need:
        return (f"{head} does not fit: the engine's budget {gib(plan.budget)} < its needs {gib(plan.need)} "
                f"({plan.form}); turn {_engine_knob(plan, others, free, card)}")
    total = est.peak + CUDA_CONTEXT
    dense = next((t for t in est.terms if t.name == DENSE_COPIES), None)
    if total > card and dense is not None and est.device == "cuda":
        lean = replace(est, terms=[t for t in est.terms if t is not dense])
        if lean.peak + CUDA_CONTEXT <= card:
            return (f"{head} fits with 4-bit decoding: peak {gib(lean.peak)} ({lean.peak_phase}) + CUDA context "
                    f"allowance {gib(CUDA_CONTEXT)} = {gib(lean.peak + CUDA_CONTEXT)}; the decode loop's dense copies "
                    f"({gib(dense.bytes)}) do not fit beside it, so generation keeps the 4-bit layers (slower)")
        est, total = lean, lean.peak + CUDA_CONTEXT
    if total > card:
        if est.peak_phase == "training":
            knob = ("model.gradient_checkpointing: true" if not params.model.gradient_checkpointing
                    else f"train.passes.micro_batches: more than {params.train.passes.micro_batches}")
        else:
            knob = "train.rollouts.generation_batch_size: fewer completions per call"
        return (f"{head} does not fit: peak {gib(est.peak)} ({est.peak_phase}) + CUDA context "
                f"{gib(CUDA_CONTEXT)} = {gib(total)}; turn {knob}")
    return (f"{head} fits: peak {gib(est.peak)} ({est.peak_phase}) + CUDA context allowance {gib(CUDA_CONTEXT)} = "
            f"{gib(total)}")


# ------------------------------------------------------------------------------------- measured
MEASURED_FILE = Path(__file__).with_name("measured.yaml")
"""The measured figures (one home: docs/benchmarks.md shows the same file)."""
MEASURED_KEYS = ("what", "command", "date", "commit", "device", "shape", "params", "figure")


def load_measured(path: Path = MEASURED_FILE) -> list[dict]:
    """The entries of ``path`` (see its header); a malformed entry raises one line naming the file."""
    import yaml

    entries = yaml.safe_load(path.read_text())
    if not isinstance(entries, list):
        raise ValueError(f"{path}: expected a list of entries")
    for i, m in enumerate(entries):
        missing = [k for k in MEASURED_KEYS if not isinstance(m, dict) or k not in m]
        if missing:
            raise ValueError(f"{path}: entry {i}: missing {', '.join(missing)}")
    return entries


def _get(params, key: str):
    """The value at the dotted ``key`` (``train.rollouts.group_size``; a mapping's entry by name)."""
    node = params
    for part in key.split("."):
        node = node[part] if isinstance(node, dict) else getattr(node, part)
    return node


def _with(params, values: dict):
    """``params`` with the dotted keys of ``values`` replaced (no validation: the values are measured ones)."""
    for key, value in values.items():
        params = _replaced(params, key.split("."), value)
    return params


def _replaced(node, parts: list[str], value):
    """A copy of ``node`` (a model or a mapping) with the value at ``parts`` replaced."""
    head, rest = parts[0], parts[1:]
    new = _replaced(node[head] if isinstance(node, dict) else getattr(node, head), rest, value) if rest else value
    return {**node, head: new} if isinstance(node, dict) else node.model_copy(update={head: new})


def measured_for(params, shapes: ModelShapes, device: str, prompt_tokens: int) -> list[str]:
    """Lines comparing with the measured figures (``measured.yaml``) for this model and device: at
    this very shape, or the nearest measured one (its differences named, with the estimate at that
    shape), or a line saying none was measured."""
    out = []
    for m in load_measured():
        if m["device"] != device or any(getattr(shapes, k) != v for k, v in m["shape"].items()):
            continue
        figure = m["figure"] or f"not measured yet (no GPU so far; `{m['command']}` measures it)"
        diffs = [f"{k.partition('.')[2]}={v} (here {_get(params, k)})" for k, v in m["params"].items()
                 if _get(params, k) != v]
        if not diffs:
            out.append(f"measured, {m['what']}, this shape: {figure}")
            continue
        there = estimate(_with(params, m["params"]), shapes, device, prompt_tokens)
        out.append(f"measured, {m['what']}, the nearest measured shape ({', '.join(diffs)}): {figure}; "
                   f"this estimate at that shape: {gib(there.peak)} (prompt {prompt_tokens} tokens)")
    return out or [f"measured: no figure for this model on {device} (src/grpo/tools/measured.yaml)"]
