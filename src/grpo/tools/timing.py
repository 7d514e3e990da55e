"""How long each computing stage takes on a card: a model for ``grpo check``, not a measurement.

Contract: ``stage_seconds(params, shapes, card)`` returns, per stage that computes on the card
(``sent``, ``baseline_eval``, ``train``, ``final_eval``), its modelled seconds and the counts behind
them; ``format_times`` prints them for every card of ``CARDS``.

The model (docs/gpu-quickstart.md shows its figures; docs/benchmarks.md, "The update's work,
counted", how far the measured card was from each floor):

- A decode step (one token for every row of a call) reads the dense weights and the KV cache of its
  rows once: its floor is those bytes over the card's bandwidth. The part of the reference card's
  measured step above its own floor (launches, host work, small kernels) is taken to be the same
  on every card, so ``step(card) = floor(card) + measured(ref) - floor(ref)``.
- An update is its matmul FLOPs over the card's dense bf16 rate (its floor), plus the reference
  card's measured update above its floor, scaled by passes x micro-batches (launch-bound): forward, checkpointed recompute and the backward to the
  activations are ``3 x 2 x params x tokens`` per update pass (the frozen weights get no gradient;
  LoRA's own work is under 1%), ``train.loss.mu`` passes a step.
- A stage's decode calls run one after another, each to ``max_new_tokens`` (every completion full
  length: an upper bound where answers end early); prefill, loading and the engines' start-up are
  left out (seconds to minutes, not hours).

The reference figures are measured (``measured_times.yaml``: the H200's compiled decode step at 16
rows and seed 003's update); the cards' bandwidth and dense rate are their vendors' data sheets.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from grpo.core.model_shapes import ModelShapes

MEASURED_TIMES = Path(__file__).with_name("measured_times.yaml")


@dataclass(frozen=True)
class Card:
    """What the roofline needs of a card; ``source`` says where each figure comes from."""

    name: str
    bandwidth: float  # bytes / s of device memory
    tensor_flops: float  # dense bf16/fp16 tensor-core FLOP/s with fp32 accumulation
    fp32_flops: float  # FLOP/s of fp32 matmuls (no TF32: torch's default for matmuls)
    launch_s: float  # cost of one kernel launch
    sms: int  # streaming multiprocessors (bitsandbytes' kernel choice reads them)
    capability: tuple[int, int]
    source: str


CARDS = {
    "h200": Card("NVIDIA H200 SXM", 4.8e12, 989e12, 67e12, 5e-6, 132, (9, 0),
                 "NVIDIA H200 spec sheet: HBM3e 4.8 TB/s, BF16/FP16 tensor 1,979 TFLOP/s with sparsity "
                 "(989 dense), FP32 67 TFLOP/s; 132 SMs, sm_90; launch cost assumed 5 us"),
    "rtx3060ti": Card("NVIDIA GeForce RTX 3060 Ti", 448e9, 32.4e12, 16.2e12, 5e-6, 38, (8, 6),
                      "NVIDIA spec sheet: 8 GB GDDR6 at 14 Gbps on 256 bits = 448 GB/s, 38 SMs, 4,864 CUDA "
                      "cores, boost 1,665 MHz, sm_86; Ampere GA10x tensor cores (GA102 whitepaper): 512 dense "
                      "fp16 FMA per SM per clock with fp16 accumulation = 64.8 TFLOP/s at boost, half that "
                      "with fp32 accumulation (bf16 and torch's fp16 matmuls accumulate in fp32) = 32.4; "
                      "FP32 16.2 TFLOP/s; launch cost assumed 5 us"),
}
"""Cards the model knows, by name: the data-sheet figures (``source``) of each; the launch cost is an
assumption (bench/step_model.py counts launches; docs/benchmarks.md compares with the measured card)."""


@dataclass(frozen=True)
class Reference:
    """What the reference card measured (``measured_times.yaml``)."""

    card: str
    decode_step_s: float  # one token for ``decode_rows`` rows at ``decode_positions`` positions
    decode_rows: int
    decode_positions: int
    update_s: float  # one step's update at ``update_rows`` x ``update_positions``, ``update_mu`` passes
    update_rows: int
    update_positions: int
    update_mu: int
    update_micro_batches: int


def load_reference(path: Path = MEASURED_TIMES) -> Reference:
    """The reference card's measured decode step and update."""
    d = yaml.safe_load(path.read_text())
    dec, upd = d["decode_step"], d["update"]
    return Reference(d["card"], dec["seconds"], dec["rows"], dec["positions"], upd["seconds"], upd["rows"],
                     upd["positions"], upd["mu"], upd["micro_batches"])


def dense_bytes(shapes: ModelShapes, b: int = 2) -> int:
    """Every parameter in a ``b``-byte dtype: what a decode step reads (dense copies or an engine's weights)."""
    return shapes.total_params * b


def kv_bytes(shapes: ModelShapes, rows: int, positions: int, b: int = 2) -> int:
    """Keys and values of ``rows`` x ``positions`` tokens."""
    return 2 * shapes.layers * shapes.kv_heads * shapes.head_dim * b * rows * positions


def decode_floor_s(shapes: ModelShapes, card: Card, rows: int, positions: int) -> float:
    """One decode step's bandwidth floor: the weights and the rows' KV cache (half full on average) read once."""
    return (dense_bytes(shapes) + kv_bytes(shapes, rows, positions) / 2) / card.bandwidth


def update_flops(shapes: ModelShapes, rows: int, positions: int, mu: int) -> float:
    """Matmul FLOPs of one step's update: ``mu`` passes of forward + recompute + backward to the inputs."""
    return mu * 3 * 2 * shapes.total_params * rows * positions


def decode_step_s(shapes: ModelShapes, card: Card, rows: int, positions: int, ref: Reference) -> float:
    """One decode step on ``card``: its floor plus the reference card's measured excess over its own."""
    ref_card = CARDS[ref.card]
    excess = ref.decode_step_s - decode_floor_s(shapes, ref_card, ref.decode_rows, ref.decode_positions)
    return decode_floor_s(shapes, card, rows, positions) + max(excess, 0.0)


def update_s(shapes: ModelShapes, card: Card, rows: int, positions: int, mu: int, micro_batches: int,
             ref: Reference) -> float:
    """One step's update on ``card``: its FLOP floor plus the reference card's measured excess, scaled
    by the passes and micro-batches (the excess is kernel launches, whose count follows the
    micro-batches, not the rows: bench/step_model.py)."""
    ref_card = CARDS[ref.card]
    ref_floor = update_flops(shapes, ref.update_rows, ref.update_positions, ref.update_mu) / ref_card.tensor_flops
    scale = (micro_batches * mu) / (ref.update_micro_batches * ref.update_mu)
    return update_flops(shapes, rows, positions, mu) / card.tensor_flops + max(ref.update_s - ref_floor, 0.0) * scale


@dataclass(frozen=True)
class StageTime:
    """A stage's modelled seconds and what they count."""

    seconds: float
    how: str


def _calls_s(shapes, card, ref, rows_total: int, per_call: int, samples: int, new: int, prompt: int) -> tuple[float, int]:
    """Seconds of ``ceil(rows_total / per_call)`` decode calls of ``per_call x samples`` rows, ``new`` tokens each."""
    calls = math.ceil(rows_total / per_call) if rows_total else 0
    return calls * new * decode_step_s(shapes, card, per_call * samples, prompt + new, ref), calls


def stage_seconds(params, shapes: ModelShapes, card: Card, prompt: int, ref: Reference | None = None
                  ) -> dict[str, StageTime]:
    """The modelled seconds of each computing stage of ``params`` on ``card`` (prompts of ``prompt`` tokens)."""
    ref = ref or load_reference()
    d, s, e, t = params.data, params.sent, params.evaluate, params.train
    out = {}
    sec, calls = _calls_s(shapes, card, ref, d.train_size, s.batch_prompts, s.num_samples, s.max_new_tokens, prompt)
    out["sent"] = StageTime(sec, f"{calls} calls x {s.max_new_tokens} token steps of {s.batch_prompts * s.num_samples} rows")
    sec, calls = _calls_s(shapes, card, ref, d.test_size, e.batch_prompts, 1, e.max_new_tokens, prompt)
    for stage in ("baseline_eval", "final_eval"):
        out[stage] = StageTime(sec, f"{calls} calls x {e.max_new_tokens} token steps of {e.batch_prompts} rows")
    r = t.rollouts
    rows, new = r.prompts_per_step * r.group_size, r.max_new_tokens
    step = new * decode_step_s(shapes, card, rows, prompt + new, ref) + update_s(
        shapes, card, rows, prompt + new, t.optimizer.mu, t.passes.micro_batches, ref)
    cp = t.checkpoints
    evals = t.steps // cp.eval_every if cp.eval_every and d.val_size else 0
    val, _ = _calls_s(shapes, card, ref, d.val_size, e.batch_prompts, 1, cp.eval_max_new_tokens, prompt)
    out["train"] = StageTime(t.steps * step + evals * val, f"{t.steps} steps of {rows} rows x {new} token steps "
                             f"+ an update of mu {t.optimizer.mu}; {evals} validations")
    return out


def clock(seconds: float) -> str:
    """``seconds`` as h:mm or m:ss."""
    m = round(seconds) // 60
    return f"{m // 60}h{m % 60:02d}" if m >= 60 else f"{m}m{round(seconds) % 60:02d}s"


def format_times(params, shapes: ModelShapes, prompt: int) -> list[str]:
    """``grpo check``'s lines: each computing stage's modelled time on every card of ``CARDS``."""
    ref = load_reference()
    per_card = {name: stage_seconds(params, shapes, card, prompt, ref) for name, card in CARDS.items()}
    lines = [f"time: each stage, modelled: the card's bandwidth and bf16 floors + the {ref.card}'s measured overhead "
             "above its own (every completion full length; loading and engine start-up left out)",
             f"  {'stage':<14} " + "  ".join(f"{name:>9}" for name in CARDS)]
    for stage, first in per_card[next(iter(CARDS))].items():
        cells = "  ".join(f"{clock(per_card[name][stage].seconds):>9}" for name in CARDS)
        lines.append(f"  {stage:<14} {cells}  ({first.how})")
    return lines
