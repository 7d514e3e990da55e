"""The update's and one decode step's work counted on the CPU, and a modelled time per card.

The project's own code runs at a params file's shapes on fake CUDA tensors (``bench/cuda_memory.py``'s
machinery: ``FakeTensorMode`` on a "cuda" device, the policy as ``grpo.model.lora_policy`` builds it, NF4 as
bitsandbytes builds it, the real ``GRPOTrainer``):

* ``update``: one step's no-grad passes and update, as ``GRPOTrainer.train_step`` runs them after
  the rollouts (``PolicyPasses.step_normalizer``, ``fixed_logprobs``, ``GRPOTrainer.update``: ``mu``
  updates of every micro-batch's forward and backward, the optimizer's steps), with AdamW's
  moments made first (``warm_optimizer``), as in every step but the first.
  ``bench/device_update.py`` timed the same call on the H200 (its ``step_s``).
* ``decode_token``: one iteration of the static decode loop (``grpo.rollout.sampling.static_loop``, the loop
  ``decode.loop: auto`` runs on CUDA, its step not compiled) on the dense copies with LoRA folded in
  (``grpo.model.nf4_layers.dequantized_weights``, as ``TransformersBackend`` decodes), all
  ``prompts_per_step x group_size`` rows, the ``StaticCache`` at the preset's ``prompt +
  max_new_tokens`` positions: the sampler's ops, the loop's bookkeeping and one forward. The loop's
  second step call is where counting starts, its third where it stops.
* ``decode_profile_check``: the whole call ``bench/decode_speed.py --profile`` profiled on the H200
  (16 rows, 8 tokens, the dense copies made on entry, the prefill), its launches per token beside the
  profiler's.

Every operator that reaches the dispatcher is counted by a ``TorchDispatchMode`` (``OpCounter``)
under ``torch.utils.flop_counter.FlopCounterMode``: its FLOPs (the flop counter's own formulas:
matmuls and attention; elementwise ops count 0), the bytes it moves (the sizes of its tensor inputs
and outputs: a lower bound of its traffic, each byte once) and whether it launches a kernel (a view
or an allocation does not; an op on CPU tensors does not; ``.item()`` is a copy to the host and a
sync). bitsandbytes' fused op ``bitsandbytes::gemm_4bit`` is expanded as its CUDA backend runs it on
each card (``Bnb4bitGemm``: the backend's own heuristic, read from the pinned bitsandbytes, picks the
fused kernel or dequantisation + ``F.linear``). The Triton kernels' launches, replaced by their
outputs on fake tensors, are counted with the logits they read and write.

The modelled time of each op on each card (``CARDS``, the one home of the cards' figures) is
``max(flops / peak, bytes / bandwidth) + launches x launch cost``: a roofline per op plus a fixed
cost per kernel. It assumes no overlap of the host's launch cost with the card's work and no cache
reuse between ops; docs/benchmarks.md ("The update's work, counted") sets it beside the measured
figures (``MEASURED``: docs/gpu-runs/).

Variants (``VARIANTS``): the update counted again under other params: those that change only time
and memory (the micro-batches), the update's rows, and the rules and ``mu`` the cost grid weighed
(docs/results.md), one of them at the settings of the H200's measured update (``MEASURED_VARIANT``).

    python bench/step_model.py --json FILE [--params presets/seed003.yaml] [--variants all|none|NAME,...]
"""

from __future__ import annotations

import argparse
import ast
import json
import math
import re
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_cuda  # noqa: E402  (before torch: see fake_cuda.load)

from grpo.tools.timing import CARDS, Card  # noqa: E402  (the cards' data-sheet figures; imports no torch)

REPO = Path(__file__).resolve().parents[1]


# the cards: grpo.tools.timing.CARDS, the one home of their data-sheet figures (grpo check's times read them too)


MEASURED_DIR = REPO / "docs" / "gpu-runs" / "2026-11-28-h200"


def measured() -> dict:
    """The H200's figures this model is set beside, read from the device runs' JSON (docs/gpu-runs/)."""
    check = json.loads((MEASURED_DIR / "device_check.json").read_text())["update"]
    gen = json.loads((MEASURED_DIR / "call2-gen2.json").read_text())
    return {
        "source": str(MEASURED_DIR.relative_to(REPO)),
        "update": {"seconds": check["step_s"], "rows": check["rows"], "prompt_tokens": check["prompt_tokens"],
                   "completion_tokens": check["completion_tokens"], "micro_batches": check["micro_batches"],
                   "entropy_rule": check["entropy_rule"]},
        "decode": {"rows": gen["rows"], "prompt_tokens": gen["prompt_tokens"],
                   "static_ms_per_token": gen["variants"]["dense-static"]["ms_per_token"],
                   "static_tokens": gen["variants"]["dense-static"]["tokens"],
                   "graph_ms_per_token": gen["variants"]["dense-static-graph"]["ms_per_token"],
                   "profile_tokens": gen["profile_before"]["tokens"],
                   "static_launches_per_token": gen["profile_before"]["launches_per_token"],
                   "static_cuda_ms_per_token": gen["profile_before"]["cuda_ms_per_token"],
                   "static_cpu_ms_per_token": gen["profile_before"]["cpu_ms_per_token"],
                   "graph_launches_per_token": gen["profile_after"]["launches_per_token"],
                   "graph_cuda_ms_per_token": gen["profile_after"]["cuda_ms_per_token"]},
    }


# ------------------------------------------------------------------------------------- bitsandbytes' 4-bit gemm
class Bnb4bitGemm:
    """How bitsandbytes' CUDA backend runs ``bitsandbytes::gemm_4bit`` on a card: its own heuristic
    ``_gemm_4bit_use_custom_cuda`` and dispatch constants, read from the pinned package's
    ``backends/cuda/ops.py`` (that module does not import on a CPU-only build: its ctypes set-up
    needs the CUDA library) and run with the card's SM count and capability."""

    def __init__(self):
        import importlib.util

        import torch

        path = Path(importlib.util.find_spec("bitsandbytes").submodule_search_locations[0]) / "backends" / "cuda" / "ops.py"
        tree = ast.parse(path.read_text())
        fn = next(n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "_gemm_4bit_use_custom_cuda")
        fn.decorator_list = []  # functools.cache keyed by device index: one card per namespace here instead
        consts = {}
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name) \
                    and node.targets[0].id in ("_GEMM_4BIT_CUSTOM_FLOOR_M", "_gemm_4bit_custom_max_m") \
                    and node.targets[0].id not in consts:  # the first assignment: the CUDA branch (not ROCm's)
                consts[node.targets[0].id] = ast.literal_eval(node.value)
        self.path, self.line, self.max_m = path, fn.lineno, consts["_gemm_4bit_custom_max_m"]
        self._code = compile(ast.Module([fn], type_ignores=[]), str(path), "exec")
        self._consts, self._torch, self._fns, self._memo = consts, torch, {}, {}

    def custom(self, card: Card, dtype, m: int, n: int, k: int, blocksize: int) -> bool:
        """Whether the fused kernel runs (else dequantisation + ``F.linear``), as the backend's
        ``gemm_4bit`` decides: past ``_gemm_4bit_custom_max_m`` rows or a K not a multiple of the
        block, the fallback; else the heuristic."""
        key = (card.name, dtype, m, n, k, blocksize)
        if key not in self._memo:
            if card.name not in self._fns:
                ns = {"torch": self._torch, **self._consts,
                      "_gpu_dispatch_props": lambda _index, c=card: (c.sms, *c.capability)}
                exec(self._code, ns)
                self._fns[card.name] = ns["_gemm_4bit_use_custom_cuda"]
            self._memo[key] = m <= self.max_m and k % blocksize == 0 and bool(self._fns[card.name](0, dtype, m, n, k))
        return self._memo[key]

    def kernels(self, card: Card, a: dict) -> list[tuple[str, float, float, int, bool]]:
        """``(name, flops, bytes, launches, tensor cores)`` of one call with arguments ``a``."""
        A, B, out = a["A"], a["B"], a["out"]
        n, k = a["shapeB"]
        m = A.numel() // k
        flops = 2.0 * m * n * k
        size = lambda t: 0 if t is None else t.numel() * t.element_size()  # noqa: E731
        if self.custom(card, A.dtype, m, n, k, a["blocksize"]):
            moved = sum(size(a.get(x)) for x in ("A", "B", "absmax", "bias", "absmax_8bit", "absmax_code", "absmax_offset"))
            return [("bitsandbytes::gemm_4bit (fused kernel)", flops, moved + size(out), 1, True)]
        dense = n * k * A.element_size()  # the dequantised weight, written then read
        steps = []
        absmax_f32 = a["absmax_8bit"].numel() * 4 if a.get("absmax_8bit") is not None else size(a["absmax"])
        if a.get("absmax_8bit") is not None:  # nested statistics: the absmax dequantised, then offset
            steps.append(("bitsandbytes::dequantize_blockwise (gemm_4bit's absmax)", 0.0,
                          size(a["absmax_8bit"]) + size(a["absmax"]) + size(a["absmax_code"]) + absmax_f32, 1, False))
            steps.append(("aten::add (gemm_4bit's absmax + offset)", 0.0, 2 * absmax_f32 + size(a["absmax_offset"]), 1, False))
        steps.append(("bitsandbytes::dequantize_4bit (gemm_4bit's fallback)", 0.0, size(B) + absmax_f32 + dense, 1, False))
        steps.append(("aten::linear (gemm_4bit's fallback)", flops, size(A) + dense + size(a.get("bias")) + size(out), 1, True))
        return steps


# ------------------------------------------------------------------------------------- the counter
NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "_unsafe_view", "lift_fresh",
             "detach", "alias", "set_", "resize_", "resize_as_", "_reshape_alias", "sym_size", "sym_stride",
             "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type", "record_stream"}
"""Ops (by packet name) that allocate or relabel without a kernel."""
SYNCS = {"_local_scalar_dense", "nonzero", "masked_select", "equal", "item"}
"""Ops whose result the host waits for (a device-to-host copy)."""
TENSOR_CORE = {"mm", "addmm", "bmm", "baddbmm", "convolution", "_scaled_dot_product_efficient_attention",
               "_scaled_dot_product_efficient_attention_backward", "_scaled_dot_product_flash_attention",
               "_scaled_dot_product_flash_attention_backward", "_scaled_dot_product_cudnn_attention",
               "_scaled_dot_product_cudnn_attention_backward", "_efficient_attention_forward",
               "_efficient_attention_backward", "_flash_attention_forward", "_flash_attention_backward"}
"""Ops whose FLOPs run on tensor cores in bf16/fp16."""
OVERWRITES = {"copy_", "fill_", "zero_", "normal_", "uniform_", "bernoulli_", "random_", "exponential_"}
"""In-place ops that write their first argument without reading it: its bytes count once."""
PARTIAL_WRITES = {"index_copy_", "index_put_", "_index_put_impl_", "scatter_", "scatter_add_", "scatter_reduce_",
                  "masked_scatter_", "index_add_"}
"""In-place ops that write part of their first argument (a KV cache's new position): what they read and
the values they write count, not the whole destination."""
FOREACH_TENSORS = 64
"""Tensors per kernel of a ``_foreach_*`` op (torch's multi-tensor apply packs tens of tensors a launch;
assumed)."""


@dataclass
class Totals:
    calls: int = 0
    flops: float = 0.0
    bytes: float = 0.0
    launches: int = 0
    seconds: float = 0.0

    def add(self, flops, nbytes, launches, seconds, calls=1):
        self.calls += calls
        self.flops += flops
        self.bytes += nbytes
        self.launches += launches
        self.seconds += seconds


@dataclass
class CardCount:
    ops: dict = field(default_factory=dict)  # name -> Totals
    phases: dict = field(default_factory=dict)  # phase -> Totals
    roofline_s: float = 0.0
    launch_s: float = 0.0


def phase_group(name: str) -> str:
    """``bench/cuda_memory.instrument``'s phase names with the micro-batch numbers taken out."""
    return re.sub(r"micro-batch \d+ forward\+backward.*", "micro-batches forward+backward", name)


def moved_bytes(name: str, args, ins: list, outs: list) -> int:
    """Bytes an op moves: the sizes of its tensor inputs and outputs (``OVERWRITES`` and
    ``PARTIAL_WRITES``: what it reads, plus what it writes)."""
    import torch

    size = lambda t: t.numel() * t.element_size()  # noqa: E731
    if (name in OVERWRITES or name in PARTIAL_WRITES) and args and isinstance(args[0], torch.Tensor):
        dest = args[0]
        others = [t for t in ins if t is not dest]
        written = size(dest) if name in OVERWRITES else sum(size(t) for t in others if t.dtype == dest.dtype)
        return sum(size(t) for t in others) + written
    return sum(size(t) for t in ins + outs)


class OpCounter:
    """Counts what runs while ``active`` (see the module docstring), per card: a dispatch mode
    (``mode()``) for the dispatcher's ops and ``kernel`` for launches the dispatcher does not see.
    ``phase`` names where the ops run (``bench/cuda_memory.instrument`` sets it)."""

    def __init__(self, cards: dict, flop_registry: dict, gemm: Bnb4bitGemm):
        self.cards, self.registry, self.gemm = cards, flop_registry, gemm
        self.active, self.phase, self.on_reset = False, "update", []
        self.reset()

    def reset(self) -> None:
        self.count = {key: CardCount() for key in self.cards}
        self.flops, self.syncs = 0.0, 0

    def kernel(self, name: str, flops: float, nbytes: float, launches: int = 1, tensor: bool = False,
               dtype=None) -> None:
        """One op's work, modelled on every card: ``max(flops / peak, bytes / bandwidth)`` plus its launches."""
        for key, card in self.cards.items():
            self._add(key, card, name, flops, nbytes, launches, tensor, dtype)
        self.flops += flops

    def _add(self, key, card, name, flops, nbytes, launches, tensor, dtype) -> None:
        import torch

        rate = card.tensor_flops if tensor and dtype in (torch.bfloat16, torch.float16, None) else card.fp32_flops
        roof = max(flops / rate, nbytes / card.bandwidth)
        c = self.count[key]
        c.roofline_s += roof
        c.launch_s += launches * card.launch_s
        seconds = roof + launches * card.launch_s
        c.ops.setdefault(name, Totals()).add(flops, nbytes, launches, seconds)
        c.phases.setdefault(phase_group(self.phase), Totals()).add(flops, nbytes, launches, seconds)

    def record(self, func, args, kwargs, out) -> None:
        import torch
        from torch.utils._pytree import tree_flatten

        name = func.overloadpacket.__name__
        ins = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        outs = [t for t in tree_flatten(out)[0] if isinstance(t, torch.Tensor)]
        if not any(t.device.type == "cuda" for t in ins + outs):
            return  # host tensors: no kernel
        if name in SYNCS:
            self.syncs += 1
        if func.is_view or name in NO_KERNEL:
            return
        if func.namespace == "bitsandbytes" and name == "gemm_4bit":
            schema = [a.name for a in func._schema.arguments]
            bound = {**dict(zip(schema, args)), **kwargs, "out": out}
            for key, card in self.cards.items():
                for kname, flops, nbytes, launches, tensor in self.gemm.kernels(card, bound):
                    self._add(key, card, kname, flops, nbytes, launches, tensor, bound["A"].dtype)
            self.flops += 2.0 * bound["A"].numel() * bound["shapeB"][0]
            return
        nbytes = moved_bytes(name, args, ins, outs)
        if nbytes == 0:
            return
        pkt = func.overloadpacket
        flops = float(self.registry[pkt](*args, **kwargs, out_val=out)) if pkt in self.registry else 0.0
        launches = math.ceil(len(ins) / FOREACH_TENSORS) if name.startswith("_foreach_") else 1
        dtype = ins[0].dtype if ins else outs[0].dtype
        self.kernel(f"{func.namespace}::{name}", flops, nbytes, launches, name in TENSOR_CORE, dtype)

    def mode(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                out = func(*args, **kwargs)
                if counter.active and func is not torch.ops.prim.device.default:
                    counter.record(func, args, kwargs, out)
                return out

        return Mode()

    def summary(self, top: int, flop_counter_flops: float | None = None) -> dict:
        """The JSON of what was counted: totals (bytes and launches are the first card's: a card's
        bitsandbytes path may differ), per card the modelled seconds and top ops, per phase."""
        first = next(iter(self.cards))
        out = {"flops": self.flops}
        if flop_counter_flops is not None:
            out["flop_counter_flops"] = flop_counter_flops
        cards = {}
        for key, c in self.count.items():
            total = c.roofline_s + c.launch_s
            ops = sorted(c.ops.items(), key=lambda kv: -kv[1].seconds)
            cards[key] = {
                "bytes": sum(t.bytes for t in c.ops.values()), "launches": sum(t.launches for t in c.ops.values()),
                "seconds": total, "roofline_s": c.roofline_s, "launch_s": c.launch_s,
                "compute_floor_s": self.flops / self.cards[key].tensor_flops,
                "top_ops": [{"op": name, "calls": t.calls, "flops": t.flops, "bytes": t.bytes, "launches": t.launches,
                             "seconds": t.seconds, "share": t.seconds / total if total else 0.0} for name, t in ops[:top]],
                "phases": {name: {"flops": t.flops, "bytes": t.bytes, "launches": t.launches, "seconds": t.seconds}
                           for name, t in c.phases.items()},
            }
        out.update(bytes=cards[first]["bytes"], launches=cards[first]["launches"], syncs=self.syncs,
                   seconds={key: cards[key]["seconds"] for key in cards}, top_ops=cards[first]["top_ops"], cards=cards)
        return out


def global_flop_counter(custom_mapping: dict):
    """``torch.utils.flop_counter.FlopCounterMode`` counting globally: its module tracker, whose
    backward hooks fail inside ``torch.autograd.grad`` ("A leaf node was passed to
    _will_engine_execute_node"; the chunked LM head calls it), is not entered; only "Global" is kept."""
    from torch.utils.flop_counter import FlopCounterMode, _FlopCounterMode

    class GlobalFlopCounter(FlopCounterMode):
        def __enter__(self):
            self.flop_counts.clear()
            self.mode = _FlopCounterMode(self)
            self.mode.__enter__()
            return self

        def __exit__(self, *args):
            b = self.mode.__exit__(*args)
            self.mode = None
            return b

    return GlobalFlopCounter(display=False, custom_mapping=custom_mapping)


def count_triton(counter: OpCounter) -> None:
    """Count the Triton kernels' launches, which ``fake_cuda.trace.patch_torch`` replaced by their
    outputs: the fused entropy/log-prob kernel reads its (rows, V) logits once; the LM head's
    log-prob-gradient kernel reads them twice and writes their gradient over them."""
    import importlib

    for module, name, passes in (("grpo.algorithm.kernels.entropy_logprob", "entropy_logprob_triton", 1),
                                 ("grpo.algorithm.kernels.logprob_grad", "logprob_grad_triton", 3)):
        mod = importlib.import_module(module)
        replaced = getattr(mod, name)

        def counted(logits, targets, block=4096, _replaced=replaced, _name=name, _passes=passes):
            outs = _replaced(logits, targets, block)
            if counter.active:
                rows, vocab = logits.shape
                moved = _passes * logits.numel() * logits.element_size() + targets.numel() * targets.element_size() + 8 * rows
                counter.kernel(f"triton::{_name.removesuffix('_triton')}", 0.0, moved, 1, False)
            return outs

        setattr(mod, name, counted)


# ------------------------------------------------------------------------------------- the runs
MEASURED_VARIANT = "archer, mu 2, every group kept, micro_batches 8 (the H200's measured update)"
"""The variant at the settings of the H200's measured update (``MEASURED_DIR``: seed 003 before the
cost grid changed the default and before its micro-batches went from 8 to 2)."""

VARIANTS = {
    # name -> (departures from the params, share of the step's groups the update keeps)
    "micro_batches 8 (seed 003 before 2)": ({"train.passes.micro_batches": 8}, 1.0),
    "micro_batches 4": ({"train.passes.micro_batches": 4}, 1.0),
    "micro_batches 1": ({"train.passes.micro_batches": 1}, 1.0),
    "half the groups uniform (dropped)": ({}, 0.5),
    "mu 2": ({"train.optimizer.mu": 2}, 1.0),
    "high at 0.2 (the mask; the H100 runs' update)": ({"train.loss.entropy_rule": "high",
                                                       "train.loss.entropy_rule_options.high.top_quantile": 0.2}, 1.0),
    "archer, mu 2, every group kept (the default before the cost grid)": (
        {"train.loss.entropy_rule": "archer", "train.optimizer.mu": 2, "train.optimizer.equal_reward_groups": "keep"}, 1.0),
    MEASURED_VARIANT: ({"train.loss.entropy_rule": "archer", "train.optimizer.mu": 2,
                        "train.optimizer.equal_reward_groups": "keep", "train.passes.micro_batches": 8}, 1.0),
}
"""Params the update's time and rows depend on. Where the update leaves out the groups of equal
rewards (``GRPOTrainer.update_rows``: ``train.optimizer.equal_reward_groups``), which groups those are
depends on the rewards, which fake tensors do not have: every group counts as one with signal, and
the "half" variant keeps the first half of the groups, as ``update_rows`` keeps the groups with
signal. The kept share of the data-dependent stubs is each variant's ``top_quantile``."""


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", default="presets/seed003.yaml", help="params file (a preset over its workspace's params.yaml)")
    ap.add_argument("--prompt-tokens", type=int, help="prompt length (default: as `grpo check` takes it)")
    ap.add_argument("--variants", default="all", help="all, none, or names of VARIANTS joined by commas")
    ap.add_argument("--no-decode", action="store_true", help="count the update alone")
    ap.add_argument("--top", type=int, default=12, help="operators shown by modelled time")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args(argv)
    names = [] if args.variants == "none" else list(VARIANTS) if args.variants == "all" else args.variants.split(",")
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; known: {', '.join(VARIANTS)}")
    args.variant_names = names
    return args


def setup(args):
    """(params, model config, its source, prompt tokens) as ``bench/cuda_memory.py`` takes them."""
    from cuda_memory import resolve_run

    res, config, source, prompt = resolve_run(args.params, args.prompt_tokens)
    return res.params, config, source, prompt


def update_shape(p, trainer, prompt: int, rows: int) -> dict:
    t = trainer.cfg
    return {"rows": rows, "prompt_tokens": prompt, "completion_tokens": t.rollouts.max_new_tokens,
            "micro_batches": len(trainer.passes.slices(rows)), "mu": t.optimizer.mu,
            "entropy_rule": t.loss.entropy_rule, "reference_pass": trainer.passes.needs_reference(),
            "gradient_checkpointing": p.model.gradient_checkpointing, "quantization": p.model.quantization,
            "forward_layout": "packed" if trainer.passes.packed else "padded"}


def finite_as_on_a_card(trainer) -> None:
    """``GRPOTrainer.finite_everywhere`` answers True, as on a card where the values are finite: its
    all-reduce and host sync still run (and are counted), but its answer comes from an ``.item()``
    that fake tensors answer 1.0 ("not finite"), which would skip every optimizer step and stop the
    ``mu`` loop after its first update."""
    real = trainer.finite_everywhere

    def finite(sums) -> bool:
        real(sums)
        return True

    trainer.finite_everywhere = finite
    trainer.update_state = lambda: state_cloned(trainer)


def state_cloned(trainer):
    """``GRPOTrainer.update_state`` (the copy that lets ``mu > 1`` undo a step's updates) with each
    tensor cloned instead of ``copy.deepcopy``'d, which a fake CPU tensor (AdamW's ``step``) refuses:
    the same copies on a card (one copy kernel per CUDA tensor; the step counters live on the host)."""
    import torch
    from torch.utils._pytree import tree_map

    clone = lambda x: x.clone() if isinstance(x, torch.Tensor) else x  # noqa: E731
    return [p.detach().clone() for p in trainer.params], tree_map(clone, trainer.updater.state_dict())


def warm_optimizer(trainer, torch) -> None:
    """AdamW's moments made, uncounted, as a first step leaves them (an optimizer step on zero
    gradients): the counted step is then like every step but the first."""
    for q in trainer.params:
        q.grad = torch.zeros_like(q)
    trainer.updater.optimizer.step()
    trainer.updater.optimizer.zero_grad(set_to_none=True)


def run_update(trainer, batch_of, counter: OpCounter, flop_mode, rows: int | None = None) -> float:
    """One step's passes and update in ``GRPOTrainer.train_step``'s order, counted: the normaliser
    over every completion, the update's rows (the first ``rows``: ``update_rows``' groups with
    signal), the reference pass, ``mu`` updates. Returns the flop counter's FLOPs of it."""
    from grpo.training.metrics import PhaseTimer

    step = batch_of()
    before = flop_mode.get_total_flops()
    counter.active = True
    try:
        normalizer = trainer.passes.step_normalizer(step.mask)
        batch = step if rows is None or rows >= len(step) else step[:rows]
        batch = trainer.passes.fixed_logprobs(batch)
        trainer.update(batch, normalizer, step.mask, PhaseTimer())
    finally:
        counter.active = False
        counter.phase = "update"
    return float(flop_mode.get_total_flops() - before)


class OneToken(Exception):
    """Raised by the counted decode step once its iteration is counted."""


def run_decode_token(model, p, prompt: int, counter: OpCounter, flop_mode, torch) -> tuple[float, dict]:
    """One iteration of the static loop at the training call's shape (module docstring): the loop's
    ``static_step`` wrapped so that counting runs from its second call's return to its third's."""
    from grpo.model.nf4_layers import dequantized_weights
    from grpo.rollout import sampling

    r = p.train.rollouts
    prompts, group = r.prompts_per_step, r.group_size
    ids = torch.randint(10, model.config.vocab_size, (prompts, prompt), device="cuda")  # (B, P)
    mask = torch.ones_like(ids)
    original, calls, flops = sampling.static_step, [0], [0.0]

    def counted_static_step(model_, cache, attn):
        step = original(model_, cache, attn)

        def run(tokens, positions):
            out = step(tokens, positions)
            calls[0] += 1
            if calls[0] == 2:
                flops[0] = -flop_mode.get_total_flops()
                counter.active = True
            elif calls[0] == 3:
                counter.active = False
                flops[0] += flop_mode.get_total_flops()
                raise OneToken
            return out

        return run

    sampling.static_step = counted_static_step
    model.eval()
    try:
        with dequantized_weights(model):
            draw = sampling.Draw(r.max_new_tokens, {0}, 0, r.temperature, r.top_p,
                                 row_seeds=list(range(prompts * group)))
            loop = sampling.StaticLoop(p.decode.loop_options["static"])
            sampling.decode(model, ids, mask, group, draw, loop)
    except OneToken:
        pass
    finally:
        sampling.static_step = original
        counter.active = False
        model.train()
    if calls[0] < 3:
        raise SystemExit(f"the decode loop stopped after {calls[0]} steps: train.rollouts.max_new_tokens must be at least 4")
    shape = {"rows": prompts * group, "prompts": prompts, "cache_positions": prompt + r.max_new_tokens,
             "loop": "static, step not compiled", "weights": "dense copies, LoRA folded in"}
    return flops[0], shape


def run_decode_call(model, tokens: int, prompt: int, rows: int, group: int, counter: OpCounter, torch) -> None:
    """The whole call ``bench/decode_speed.py``'s profile makes (its ``Model.sample``: dense copies,
    prefill, ``tokens`` tokens of the static loop), counted."""
    from grpo.model.nf4_layers import dequantized_weights
    from grpo.rollout.sampling import Draw, StaticLoop, decode

    ids = torch.randint(10, model.config.vocab_size, (rows // group, prompt), device="cuda")
    mask = torch.ones_like(ids)
    model.eval()
    counter.active = True
    try:
        with dequantized_weights(model):
            decode(model, ids, mask, group, Draw(tokens, {0}, 0, min_new_tokens=tokens, row_seeds=list(range(rows))),
                   StaticLoop())
    finally:
        counter.active = False
        model.train()


def weight_bytes(config) -> dict:
    """Bytes a dense bf16 decode step must read at least: every dense weight once and the KV cache."""
    h, layers, v = config.hidden_size, config.num_hidden_layers, config.vocab_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    d = getattr(config, "head_dim", None) or h // heads
    per_layer = h * heads * d + 2 * h * kv * d + heads * d * h + 3 * h * config.intermediate_size
    return {"weights": 2 * (layers * per_layer + v * h), "kv_per_position_row": 2 * 2 * layers * kv * d}


def main(argv=None) -> dict:
    args = parse_args(argv)
    fake_cuda.load()
    import bitsandbytes  # noqa: F401  (registers torch.ops.bitsandbytes)
    import torch
    from cuda_memory import build_policy, instrument, make_trainer
    from fake_cuda.trace import DataDependent, patch_torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from grpo.training.trainer_builder import depart

    t0 = time.time()
    p, config, source, prompt = setup(args)
    patch_torch()
    gemm = Bnb4bitGemm()

    def gemm_flops(a_shape, b_shape, shape_b, *rest, out_shape=None, **kw):
        return 2 * math.prod(a_shape[:-1]) * shape_b[0] * shape_b[1]

    out = {"params": args.params, "model": str(source)}
    stubs = DataDependent(p.train.loss.rule_options().top_quantile)
    with FakeTensorMode(allow_non_fake_inputs=True), stubs, tempfile.TemporaryDirectory() as tmp:
        flop_mode = global_flop_counter({torch.ops.bitsandbytes.gemm_4bit: gemm_flops})
        counter = OpCounter(CARDS, flop_mode.flop_registry, gemm)
        count_triton(counter)
        model, tok = build_policy(config, p, torch)
        out["dtype"] = str(next(x for x in model.parameters() if x.is_floating_point()).dtype).removeprefix("torch.")
        trainer, batch_of = make_trainer(model, tok, p, prompt, str(Path(tmp) / "run"), torch)
        instrument(trainer, counter)
        finite_as_on_a_card(trainer)
        n = trainer.cfg.rollouts.prompts_per_step * trainer.cfg.rollouts.group_size
        with flop_mode, counter.mode():
            warm_optimizer(trainer, torch)
            fc = run_update(trainer, batch_of, counter, flop_mode)
            progress(t0, "the update")
            out["update"] = {"shape": update_shape(p, trainer, prompt, n), **counter.summary(args.top, fc)}
            variants = {}
            for name in args.variant_names:
                departures, share = VARIANTS[name]
                vp = depart(p, departures)
                vt, vbatch_of = make_trainer(model, tok, vp, prompt, str(Path(tmp) / f"run-{len(variants)}"), torch)
                vt.updater.optimizer.load_state_dict(trainer.updater.optimizer.state_dict())  # moments exist
                instrument(vt, counter)
                finite_as_on_a_card(vt)
                g = vt.cfg.rollouts.group_size
                rows = max(g, int(n // g * share) * g)
                counter.reset()
                stubs.keep = vp.train.loss.rule_options().top_quantile
                fc = run_update(vt, vbatch_of, counter, flop_mode, rows)
                stubs.keep = p.train.loss.rule_options().top_quantile
                variants[name] = {"departures": departures, "shape": update_shape(vp, vt, prompt, rows),
                                  **counter.summary(args.top, fc)}
                progress(t0, f"variant {name}")
            out["variants"] = variants
            if not args.no_decode:
                counter.reset()
                fc, shape = run_decode_token(model, p, prompt, counter, flop_mode, torch)
                out["decode_token"] = {"shape": shape, **counter.summary(args.top, fc)}
                progress(t0, "one decode step")
                m = measured()["decode"]
                counter.reset()
                run_decode_call(model, m["profile_tokens"], m["prompt_tokens"], m["rows"],
                                min(p.train.rollouts.group_size, m["rows"]), counter, torch)
                whole = counter.summary(args.top)
                out["decode_profile_check"] = {
                    "shape": {"rows": m["rows"], "prompt_tokens": m["prompt_tokens"], "tokens": m["profile_tokens"],
                              "what": "bench/decode_speed.py --profile's call: dense copies made, prefill, the static loop"},
                    "launches_per_token": whole["launches"] / m["profile_tokens"],
                    "seconds_per_token": {k: v / m["profile_tokens"] for k, v in whole["seconds"].items()},
                    "measured_launches_per_token": m["static_launches_per_token"]}
    floors = weight_bytes(config)
    if "decode_token" in out:
        essential = floors["weights"] + floors["kv_per_position_row"] * out["decode_token"]["shape"]["rows"] * \
            out["decode_token"]["shape"]["cache_positions"]
        out["decode_token"]["bandwidth_floor_s"] = {k: essential / c.bandwidth for k, c in CARDS.items()}
        out["decode_token"]["essential_bytes"] = essential
    out["cards"] = {k: {"name": c.name, "bandwidth_bytes_s": c.bandwidth, "tensor_flops": c.tensor_flops,
                        "fp32_flops": c.fp32_flops, "launch_s": c.launch_s, "source": c.source} for k, c in CARDS.items()}
    out["measured"] = measured()
    out["bitsandbytes_heuristic"] = f"{gemm.path.relative_to(gemm.path.parents[2])}:{gemm.line} (_gemm_4bit_use_custom_cuda)"
    out["data_dependent_answers"] = stubs.hits
    out["seconds"] = round(time.time() - t0, 1)
    report(out, args.top)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


# ------------------------------------------------------------------------------------- the report
def progress(t0: float, what: str) -> None:
    print(f"[{time.time() - t0:5.0f} s] counted: {what}", file=sys.stderr, flush=True)


def fmt_s(s: float) -> str:
    return f"{s:.3g} s" if s >= 1 else f"{s * 1e3:.3g} ms" if s >= 1e-3 else f"{s * 1e6:.3g} us"


def report(out: dict, top: int) -> None:
    print(f"{out['params']}: {out['model']}, {out['dtype']}; cards: " +
          "; ".join(f"{k} {c['bandwidth_bytes_s'] / 1e9:g} GB/s, {c['tensor_flops'] / 1e12:g} TFLOP/s, "
                    f"{c['launch_s'] * 1e6:g} us a launch" for k, c in out["cards"].items()))
    meas = out["measured"]
    for part in ("update", "decode_token"):
        if part not in out:
            continue
        d = out[part]
        print(f"\n{part}: {json.dumps(d['shape'])}")
        print(f"  {d['flops']:.3e} FLOP (flop counter {d.get('flop_counter_flops', 0):.3e}), {d['bytes'] / 1e9:.2f} GB moved, "
              f"{d['launches']:,} launches, {d['syncs']} host syncs")
        for key, c in d["cards"].items():
            print(f"  {key}: modelled {fmt_s(c['seconds'])} = roofline {fmt_s(c['roofline_s'])} + launches "
                  f"{fmt_s(c['launch_s'])}; arithmetic floor {fmt_s(c['compute_floor_s'])}"
                  + (f"; bandwidth floor {fmt_s(d['bandwidth_floor_s'][key])}" if "bandwidth_floor_s" in d else ""))
        c = d["cards"]["h200"]
        print(f"  top operators on the h200 by modelled time:\n    {'op':<58}{'calls':>8}{'launches':>10}{'GB':>9}"
              f"{'GFLOP':>11}{'time':>11}{'share':>7}")
        for row in c["top_ops"][:top]:
            print(f"    {row['op'][:57]:<58}{row['calls']:>8}{row['launches']:>10}{row['bytes'] / 1e9:>9.2f}"
                  f"{row['flops'] / 1e9:>11.1f}{fmt_s(row['seconds']):>11}{row['share']:>7.1%}")
        if part == "update":
            print("  phases (h200): " + "; ".join(f"{k} {fmt_s(v['seconds'])}, {v['launches']:,} launches"
                                                  for k, v in c["phases"].items()))
    if "update" in out:
        at = out.get("variants", {}).get(MEASURED_VARIANT)
        u = meas["update"]
        print(f"\nmeasured on the H200 ({meas['source']}): update {u['seconds']:.2f} s under {u['entropy_rule']}, "
              f"{u['micro_batches']} micro-batches; modelled at those settings: "
              + (fmt_s(at["seconds"]["h200"]) if at else f"not counted (variant {MEASURED_VARIANT!r})"))
    if "decode_token" in out:
        m = meas["decode"]
        chk = out["decode_profile_check"]
        print(f"measured decode: {m['static_ms_per_token']} ms per token static ({m['static_launches_per_token']} launches, "
              f"CUDA {m['static_cuda_ms_per_token']} ms, CPU {m['static_cpu_ms_per_token']} ms per token), "
              f"{m['graph_ms_per_token']} ms compiled ({m['graph_launches_per_token']} launches); counted here: "
              f"{out['decode_token']['launches']:,} launches per token at {out['decode_token']['shape']['cache_positions']} positions, "
              f"{chk['launches_per_token']:.1f} per token over the profiled call")
    if out.get("variants"):
        base = out["update"]
        print(f"\nvariants of the update (h200 / rtx3060ti modelled):\n  {'variant':<72}{'rows':>5}{'TFLOP':>8}"
              f"{'launches':>10}{'h200':>10}{'3060 Ti':>10}")
        for name, v in {"as the params say": base, **out["variants"]}.items():
            print(f"  {name:<72}{v['shape']['rows']:>5}{v['flops'] / 1e12:>8.1f}{v['launches']:>10,}"
                  f"{fmt_s(v['seconds']['h200']):>10}{fmt_s(v['seconds']['rtx3060ti']):>10}")
    print(f"\ndata-dependent answers given: {out['data_dependent_answers']}; {out['seconds']:.0f} s")


if __name__ == "__main__":
    main()
