"""Peak memory of one GRPO step, estimated from the model's shapes and the params (no weights loaded).

The model's modules are built on PyTorch's ``meta`` device from its ``config.json`` (no storage),
so every ``nn.Linear`` shape, the embeddings and which layers bitsandbytes quantises are counted
exactly as ``from_pretrained`` would build them (``model_shapes``). Sizes below: ``H`` hidden,
``I`` intermediate, ``L`` layers, ``a`` attention heads, ``k`` KV heads, ``d`` head dim, ``V``
vocabulary, ``r`` LoRA rank, ``b`` bytes of the compute dtype (2 for bf16, 4 for fp32), ``P``
prompt tokens, ``C`` = ``train.max_new_tokens`` (every completion full length: the worst case).

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
* CPU only: the dense copies of the 4-bit layers that decoding uses (``grpo.nf4.dequantized_weights``),
  ``n * b`` for every quantised weight plus another for each one a LoRA adapter wraps.

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
  completions (``C - 1`` query tokens on ``P + C - 1`` key positions). With gradient checkpointing:
  ``L * T * H * b`` per row (each layer's input) ``+ (4H + 4)`` per token (the final norm);
* the completion hidden states: ``n * T * H * b`` (``n * C * H * b`` with shared prompts);
* the largest of three working sets that are live one after another, never together (traced on
  fake CUDA tensors by ``bench/cuda_memory.py``: the body's backward starts after the LM head's has
  freed its tensors):

  - the chunked no-grad entropy/log-prob pass: ``min(logprob_chunk, n C) * V`` times ``b``
    (Triton: the logits only) or ``b + 4 + 4 [b = 2]`` (PyTorch: logits, an fp32 copy, the
    probabilities);
  - the LM head with grad at the kept tokens, ``K = entropy_top_quantile * n * C`` rows, chunked
    like the pass above (``grpo.logprobs.selected_logprobs``): ``min(logprob_chunk, K) * V`` times
    ``b`` (Triton: the logits, overwritten by their gradient) or ``4 + b [b = 2]`` (PyTorch: the
    logits and one fp32 copy; fp32 logits are worked on in place), plus ``2 K H b`` (the kept
    hidden rows and their gradient direction, saved for backward);
  - the body's backward working set: one layer's activations (recomputed under checkpointing,
    its gradients otherwise) and ``5 I b`` per token of the larger pass (``MLP_BACKWARD``: at the
    peak of the layer's backward the trace finds eight intermediate-sized tensors live, three of
    them the saved ones counted above: the product the down projection's 4-bit matmul keeps, the
    gradients of its input and of the gate and up outputs, and the gate's sigmoid).

Attention is transformers' SDPA with a padding mask (GRPO batches are ragged: prompts of several
lengths, completions that end early); the estimate is for the first, largest micro-batch.

Peak = the larger phase total (generation memory is released before training). The no-grad
passes (``beta > 0``, ``mu > 1``, the step-wide threshold with several micro-batches) hold less
than the training pass. CUDA's allocator slack, the CUDA context and, on the CPU, the process's
libraries come on top (``max_memory_allocated`` is the comparable GPU figure).

The exact parts are tested against real objects on the CPU (``tests/test_memory.py``): the LoRA
parameter count against peft's trainable parameters, the NF4 bytes against a bitsandbytes
model's storage, the KV cache against a ``DynamicCache``, the saved activations against autograd's
saved tensors.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

NF4_BLOCK = 64  # weights per absmax (bitsandbytes' default blocksize for 4-bit)
NESTED_BLOCK = 256  # absmaxes per fp32 absmax under double quantisation
NF4_LAYER_CONSTANTS = 16 * 4 + 256 * 4 + 4  # NF4 code table, nested code table, offset (fp32 each)
MLP_BACKWARD = 5  # intermediate-sized tensors of a layer's MLP backward beyond the saved activations (x b per token)
LORA_GROUPS = (("q_proj", "k_proj", "v_proj"), ("o_proj",), ("gate_proj", "up_proj"), ("down_proj",))


@dataclass(frozen=True)
class Linear:
    name: str
    in_features: int
    out_features: int
    quantized: bool

    @property
    def leaf(self) -> str:
        return self.name.rsplit(".", 1)[-1]

    @property
    def params(self) -> int:
        return self.in_features * self.out_features


@dataclass(frozen=True)
class ModelShapes:
    """The sizes the estimate needs, counted from a model built on the meta device."""

    source: str
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    linears: tuple[Linear, ...]
    other_params: int  # every parameter outside the quantised linears' weights
    total_params: int = 0

    @property
    def quantized_params(self) -> int:
        return sum(x.params for x in self.linears if x.quantized)

    def layer_linears(self) -> list[Linear]:
        """The linears of the first decoder layer (every layer has the same)."""
        first = next(x.name for x in self.linears if ".layers." in x.name)
        prefix = first[: first.index(".layers.") + len(".layers.")]
        index = first[len(prefix):].split(".", 1)[0]
        return [x for x in self.linears if x.name.startswith(f"{prefix}{index}.")]


def model_shapes(config, source: str = "") -> ModelShapes:
    """Count the modules of ``config``'s causal LM, built on the meta device (no memory, no weights).
    A linear is quantised when bitsandbytes would quantise it (transformers'
    ``get_keys_to_not_convert``: the LM head and tied weights stay in the compute dtype)."""
    import torch
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    skip = set(get_keys_to_not_convert(model))
    linears = []
    quantized_weights = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear):
            quantized = not any(name == s or name.startswith(s + ".") for s in skip)
            linears.append(Linear(name, module.in_features, module.out_features, quantized))
            quantized_weights += module.weight.numel() if quantized else 0
    total = sum(p.numel() for p in model.parameters())
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return ModelShapes(
        source=source, hidden=config.hidden_size, intermediate=config.intermediate_size,
        layers=config.num_hidden_layers, heads=heads, kv_heads=getattr(config, "num_key_value_heads", None) or heads,
        head_dim=head_dim, vocab=config.vocab_size, linears=tuple(linears), other_params=total - quantized_weights,
        total_params=total,
    )


def prepared_name(model_dir: Path) -> str | None:
    """The ``model.name`` prepare_model wrote ``model_dir`` from (its ``manifest.json``), or None
    (no manifest: not prepared by the pipeline, or not there)."""
    try:
        return json.loads((model_dir / "manifest.json").read_text()).get("name")
    except (OSError, ValueError, AttributeError):
        return None


def resolve_config(model_cfg, root: Path):
    """``(transformers config, where it came from)`` of the configured model, or a one-line reason
    why it is unknown.

    In order: ``model.path/config.json`` (read from the workspace ``root``) when that directory
    holds ``model.name`` (the ``manifest.json`` prepare_model writes names it; a directory without
    one is taken as it is), ``model.name`` when it is a local directory with a ``config.json``,
    then a named architecture of ``grpo.synthetic`` whose hub model ``model.name`` names (e.g.
    DeepSeek-R1-Distill-Qwen-1.5B -> ``qwen2-1.5b``). So a preset checked in a workspace where
    another model was prepared (``grpo check --params presets/seed003.yaml`` after the default
    pipeline) is estimated for the preset's model.
    """
    from transformers import AutoConfig

    from grpo.synthetic import architecture_config, architecture_for_model

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
        return architecture_config(arch), f"grpo.synthetic architecture {arch!r} (model.name {model_cfg.name}; {why})"
    if other is not None:
        return (f"the estimate needs {model_cfg.name!r}'s config.json: {path} holds {other!r} (prepared for other "
                f"params) and {model_cfg.name!r} is not an architecture known to grpo.synthetic")
    return (f"the estimate needs the model's config.json: {root / model_cfg.path} does not exist yet and "
            f"{model_cfg.name!r} is not an architecture known to grpo.synthetic (run prepare_model first)")


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
    return shapes.layers * 2 * shapes.kv_heads * shapes.head_dim * positions * rows * b


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
    return (2 * (4 * h + 4) + 2 * a * d * b + 4 * a + 3 * shapes.intermediate * b
            + 4 * lora_rank * len(hit) + _lora_input_bytes(shapes, hit, b, dropout, dropout_mask_bytes(device)))


def _pass_bytes(shapes, per_token, rows, q_len, kv_len, b, padded) -> int:
    kv = 2 * (shapes.heads if padded else shapes.kv_heads) * shapes.head_dim * b
    mask = b if padded else 0
    return rows * (q_len * per_token + kv_len * kv + q_len * kv_len * mask)


def activation_bytes(shapes: ModelShapes, *, rows: int, prompt: int, completion: int, group: int, b: int,
                     lora_rank: int, targets: list[str], dropout: float, checkpointing: bool, shared: bool,
                     padded: bool = True, device: str = "cuda") -> tuple[int, int]:
    """(saved by the forward, one layer's share for the backward working set) in bytes.

    Without checkpointing the first layer's input (the frozen embeddings' output) needs no
    gradient, so its q/k/v dropout saves no mask; its first norm saves nothing either, which the
    final norm makes up for."""
    per_token = layer_token_bytes(shapes, b, lora_rank, targets, dropout, device)
    t = prompt + completion
    one_layer = _pass_bytes(shapes, per_token, rows, t, t, b, padded)
    if checkpointing:
        return rows * t * (shapes.layers * shapes.hidden * b + 4 * shapes.hidden + 4), one_layer
    tokens = rows * t
    if shared and group > 1 and rows % group == 0 and completion > 1:
        one_layer = (_pass_bytes(shapes, per_token, rows // group, prompt, prompt, b, padded)
                     + _pass_bytes(shapes, per_token, rows, completion - 1, t - 1, b, padded))
        tokens = rows // group * prompt + rows * (completion - 1)
    first_masks = 0
    if dropout > 0:
        qkv = [m for m in LORA_GROUPS[0] if m in _layer_targets(shapes, targets)]
        first_masks = tokens * dropout_mask_bytes(device) * shapes.hidden * len(qkv)
    return shapes.layers * one_layer - first_masks, one_layer


def micro_batch_rows(n: int, micro_batches: int, group: int) -> int:
    """Rows of the first (largest) micro-batch of the update (``grpo.passes.micro_slices``)."""
    from grpo.passes import micro_slices

    first = micro_slices(n, micro_batches, group)[0]
    return first.stop - first.start


def generation_rows(n_prompts: int, group: int, max_completions: int) -> int:
    """Completions of the largest generate call (``grpo.collect.generation_calls``)."""
    from grpo.collect import generation_calls

    return max((hi - lo) * n for lo, hi, n in generation_calls(n_prompts, group, max_completions))


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


def _n(x: float) -> str:
    """1.54 B, 4.36 M, 12 k: a count in a few characters."""
    for unit, size in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if x >= size:
            return f"{x / size:.3g} {unit}"
    return str(int(x))


def estimate(params, shapes: ModelShapes, device: str, prompt_tokens: int, prompt_source: str = "") -> Estimate:
    """The terms of one training step's memory for ``params`` on ``device`` (``cpu`` or ``cuda``)."""
    from grpo.device import compute_dtype

    model, lora, train = params.model, params.lora, params.train
    dtype = compute_dtype(model.dtype, device)
    b = dtype.itemsize
    dname = str(dtype).removeprefix("torch.")
    g, p, c = train.group_size, prompt_tokens, train.max_new_tokens
    n_all = train.prompts_per_step * g
    n = micro_batch_rows(n_all, train.micro_batches, g)
    est = Estimate(device, dname, p, prompt_source, shapes)
    add = est.terms.append

    nf4 = model.quantization == "nf4"
    qn = shapes.quantized_params
    if nf4:
        how = (f"NF4: {_n(qn)} params in 4 bits + constants ({weight_bytes(shapes, 'nf4', b) - shapes.other_params * b:,}"
               f" B), {_n(shapes.other_params)} more in {dname}")
    else:
        how = f"{_n(shapes.total_params)} params in {dname}"
    add(Term("weights", "both", weight_bytes(shapes, model.quantization, b), how))
    n_lora = lora_params(shapes, lora.rank, lora.target_modules)
    add(Term("LoRA + AdamW", "both", 16 * n_lora,
             f"{_n(n_lora)} params x 16 B (fp32 param, grad, 2 moments)"))

    rows_gen = generation_rows(train.prompts_per_step, g, train.generation_batch_size)
    add(Term("KV cache", "generate", kv_cache_bytes(shapes, rows_gen, p + c, b),
             f"{shapes.layers} layers x 2 x {shapes.kv_heads} kv heads x {shapes.head_dim} x {p + c} positions x "
             f"{rows_gen} rows x {b} B"))
    per_entry = b + 8 + (4 if b != 4 else 0) + (13 if train.top_p < 1 else 0)
    add(Term("sampling logits", "generate", rows_gen * shapes.vocab * per_entry,
             f"{rows_gen} rows x {shapes.vocab} vocab x {per_entry} B"))
    if device == "cpu" and nf4:
        wrapped = sum(x.params for x in lora_targets(shapes, lora.target_modules) if x.quantized)
        add(Term("dense 4-bit copies (CPU)", "generate", (qn + wrapped) * b,
                 f"({_n(qn)} + {_n(wrapped)} LoRA-merged) params x {b} B"))

    gc_on = model.gradient_checkpointing
    shared = train.shared_prompt_forward and not gc_on
    saved, one_layer = activation_bytes(
        shapes, rows=n, prompt=p, completion=c, group=g, b=b, lora_rank=lora.rank, targets=lora.target_modules,
        dropout=lora.dropout, checkpointing=gc_on, shared=shared, device=device)
    per_tok = layer_token_bytes(shapes, b, lora.rank, lora.target_modules, lora.dropout, device)
    if gc_on:
        how = f"checkpointed: {n} rows x {p + c} tokens x {shapes.layers} layer inputs x {shapes.hidden} x {b} B"
    else:
        how = (f"{shapes.layers} layers x {per_tok:,} B/token + keys/values/mask, {n} rows x {p}+{c} tokens"
               + (f", prompts shared by G={g}" if shared and g > 1 else ""))
    add(Term("activations", "train", saved, how))
    hidden_tokens = n * c if shared and g > 1 else n * (p + c)
    add(Term("completion hidden states", "train", hidden_tokens * shapes.hidden * b,
             f"{hidden_tokens} tokens x {shapes.hidden} x {b} B"))
    kernel = train.kernel if train.kernel != "auto" else ("triton" if device == "cuda" else "torch")
    chunk = min(train.logprob_chunk, n * c)
    per_entry = b if kernel == "triton" else b + 4 + (4 if b != 4 else 0)
    kept = math.ceil(train.entropy_top_quantile * n * c)
    pass_tokens = max(n // g * p, n * (c - 1)) if shared and g > 1 and n % g == 0 and c > 1 else n * (p + c)
    head_rows = min(train.logprob_chunk, kept)
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
    return est


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
    section, name = key.split(".")
    return getattr(getattr(params, section), name)


def _with(params, values: dict):
    """``params`` with ``section.key`` values replaced (no validation: the values are measured ones)."""
    sections = {}
    for key, value in values.items():
        section, name = key.split(".")
        sections.setdefault(section, {})[name] = value
    return params.model_copy(update={s: getattr(params, s).model_copy(update=v) for s, v in sections.items()})


def measured_for(params, shapes: ModelShapes, device: str, prompt_tokens: int) -> list[str]:
    """Lines comparing with the measured figures (``measured.yaml``) for this model and device: at
    this very shape, or the nearest measured one (its differences named, with the estimate at that
    shape), or a line saying none was measured."""
    out = []
    for m in load_measured():
        if m["device"] != device or any(getattr(shapes, k) != v for k, v in m["shape"].items()):
            continue
        figure = m["figure"] or f"not measured yet (no GPU so far; `{m['command']}` measures it)"
        diffs = [f"{k.split('.')[1]}={v} (here {_get(params, k)})" for k, v in m["params"].items()
                 if _get(params, k) != v]
        if not diffs:
            out.append(f"measured, {m['what']}, this shape: {figure}")
            continue
        there = estimate(_with(params, m["params"]), shapes, device, prompt_tokens)
        out.append(f"measured, {m['what']}, the nearest measured shape ({', '.join(diffs)}): {figure}; "
                   f"this estimate at that shape: {gib(there.peak)} (prompt {prompt_tokens} tokens)")
    return out or [f"measured: no figure for this model on {device} (src/grpo/measured.yaml)"]


def longest_prompt_tokens(params, root: Path) -> tuple[int, str] | None:
    """Tokens of the longest training prompt (chat template and system prompt included), when the
    training rows and the model's tokenizer are in the workspace."""
    tok_dir = root / params.model.path
    rows_path = next((root / p for p in (params.train.data_path, params.sent.data_path) if (root / p).is_file()), None)
    if rows_path is None or not (tok_dir / "tokenizer_config.json").is_file():
        return None
    from grpo.base_model import load_tokenizer
    from grpo.data import build_prompt

    tok = load_tokenizer(tok_dir)
    questions = [json.loads(line)["question"] for line in rows_path.read_text().splitlines() if line.strip()]
    if not questions:
        return None
    longest = max(len(tok(build_prompt(tok, q, params.train.system_prompt), add_special_tokens=False)["input_ids"])
                  for q in questions)
    return longest, f"the longest prompt of {rows_path}"
