"""GPU memory of the real training update, traced on fake CUDA tensors on any machine (no GPU).

The project's own update runs unmodified at a params file's shapes: ``PolicyPasses.fixed_logprobs``
(the reference no-grad pass), ``GRPOTrainer.update`` (``accumulate_gradients``: the
step-wide entropy pass when there are several micro-batches, each micro-batch's
``loss_backward``; then the updater's all-reduce, clip and AdamW step). Every tensor is a
``FakeTensorMode`` tensor on a "cuda" device: shapes, dtypes and devices, no data. A dispatch mode
counts the bytes of live CUDA storages (each rounded up to 512 B as CUDA's caching allocator does)
and keeps the peak of each phase and the tensors live at the overall peak. Two steps run; the
figures are the second's (AdamW's moments exist then, as in every step but the first).

The model is built from the params' model config (``grpo.tools.memory.resolve_config``: the prepared
``config.json``, or the architecture ``grpo.tools.synthetic`` knows for ``model.name``; no weights), in the
compute dtype, with NF4 layers as bitsandbytes builds them and the LoRA adapter of ``grpo.model.lora_policy``.

Replaced (named in the output): the rollouts (the engine or decode loop; here random token ids of
``prompts_per_step * G`` rows, prompts of ``--prompt-tokens``, completions of ``max_new_tokens``,
every token valid, and engine log-probs when an engine would sample); the Triton kernels' launches
(their two fp32 row outputs are allocated, as the kernels allocate nothing else: the LM head's
writes its gradient over the logits); the answers that depend
on values (``.item()``: booleans False, numbers 1; ``torch.equal``: True, so G completions share
their prompt's forward; boolean masks keep ``ceil(entropy_top_quantile * elements)``); SDPA, routed
to the flash / memory-efficient kernels a bf16 sm80+ GPU runs (the fake mode would run the math path).

Not counted (so this is a lower bound of ``torch.cuda.max_memory_allocated``): kernel scratch,
cuBLAS workspaces, the allocator's fragmentation, the CUDA context, the vLLM engine.

Run: ``python bench/cuda_memory.py [--params presets/seed003.yaml] [--json out.json]``.
The shim this needs is ``bench/fake_cuda`` (built with g++ on first use).

``--all`` (default params: ``presets/seed003.yaml``) traces instead every CUDA call of the stages where the decode loop samples (no vLLM; the
params' backends departed to ``transformers``), each in a process of its own as the stages run
them, on a card of ``--cap-gib`` with the measured CUDA context outside the allocator
(``--context-gib``, default the H200 check's ``context.outside_forward_gib``): SENT's call,
the evaluation's call and the train step whole (its rollouts on the compiled step with their
cache and kept dense copies, validation's call, the update), each beside ``grpo check``'s
prediction (``grpo.tools.memory.decode_call``, ``grpo.tools.memory.estimate``); ``bench/fake_cuda/calls.py``
says what is replaced. ``--json`` then writes ``{"calls": {NAME: {"traced_gib", "predicted_gib",
"cap_gib", "context_gib", ...}}}``, NAME one of ``sent``, ``evaluation``, ``train_step``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import fake_cuda  # noqa: E402  (before torch: see fake_cuda.load)

REPLACED = [
    "rollouts: random token ids (every completion full length; engine log-probs when an engine samples)",
    "Triton kernels (entropy/log-prob; the LM head's log-prob gradient, written over the logits): their launches "
    "(their two fp32 row outputs are allocated)",
    ".item() answers (booleans False, numbers 1), torch.equal True, boolean masks keep ceil(q x elements)",
    "SDPA: routed to flash / memory-efficient attention as on a bf16 sm80+ GPU",
]
NOT_COUNTED = "kernel scratch, cuBLAS workspaces, fragmentation, the CUDA context, the vLLM engine"
GiB, MiB = 2**30, 2**20


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--params", help="params file (a preset over its workspace's params.yaml; default params.yaml, "
                    "with --all presets/seed003.yaml: the 8 GB card's)")
    ap.add_argument("--prompt-tokens", type=int, help="prompt length (default: as `grpo check` takes it)")
    ap.add_argument("--json", help="write the figures here")
    ap.add_argument("--top", type=int, default=10, help="largest live tensor groups shown at the peak")
    ap.add_argument("--all", action="store_true", help="every CUDA call of the stages (module docstring)")
    ap.add_argument("--cap-gib", type=float, default=7.6, help="--all: the card's memory (seed 003's 8 GB card)")
    ap.add_argument("--context-gib", type=float, help=f"--all: memory outside the allocator (default: {CONTEXT_FILE})")
    ap.add_argument("--val-prompts", type=int, default=64, help="--all: validation's problems (at most val_size)")
    ap.add_argument("--calls", default="sent,evaluation,train_step", help="--all: the calls to trace")
    args = ap.parse_args(argv)
    args.params = args.params or ("presets/seed003.yaml" if args.all else "params.yaml")
    return args


CONTEXT_FILE = "docs/gpu-runs/2026-11-28-h200/device_check.json"
"""The measured CUDA context (its ``context.outside_forward_gib``: after a forward, the allocator capped)."""
CALLS = ("sent", "evaluation", "train_step")


def resolve_run(params_path: str, prompt_tokens: int | None):
    """(the params' resolution, the model's config, its source, the prompt tokens) of a trace at
    ``params_path``'s shapes: the config as ``grpo check`` finds it (no weights), the prompt
    ``prompt_tokens`` or, as ``grpo check`` takes it, the longest prepared prompt or its default."""
    from grpo.rollout.engine.needs import longest_prompt_tokens
    from grpo.tools import memory
    from grpo.tools.check_report import DEFAULT_PROMPT_TOKENS
    from grpo.tools.cli import resolve_params

    res = resolve_params(params_path)
    found = memory.resolve_config(res.params.model, res.root)
    if isinstance(found, str):
        raise SystemExit(f"{params_path}: {found}")
    longest = None if prompt_tokens else longest_prompt_tokens(res.params, res.root)
    return res, *found, prompt_tokens or (longest[0] if longest else DEFAULT_PROMPT_TOKENS)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.all:
        return main_all(args)
    fake_cuda.load()
    import torch
    from fake_cuda.trace import DataDependent, LiveBytes, patch_torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from grpo.tools import memory
    from grpo.training.metrics import PhaseTimer

    t0 = time.time()
    res, config, source, prompt = resolve_run(args.params, args.prompt_tokens)
    p = res.params
    shapes = memory.model_shapes(config, source)
    # the trace runs the update alone: the estimate without the decode step's kept dense copies
    from grpo.training.trainer_builder import depart, departure_line

    uncompiled = {"decode.compile_step": "off"}
    print(f"estimate's departures: {departure_line(uncompiled)} (no decode step is traced)")
    est = memory.estimate(depart(p, uncompiled), shapes, "cuda", prompt)

    patch_torch()
    stubs = DataDependent(p.train.loss.rule_options().top_quantile)
    with FakeTensorMode(allow_non_fake_inputs=True), stubs, tempfile.TemporaryDirectory() as out_dir:
        model, tok = build_policy(config, p, torch)
        trace = LiveBytes(resident_tensors(model))
        trainer, batch_of = make_trainer(model, tok, p, prompt, out_dir, torch)
        instrument(trainer, trace)
        with trace:
            for step in (1, 2):
                if step == 2:
                    trace.reset()  # the figures are the second step's (AdamW's moments exist)
                batch = batch_of()
                trace.phase = "no-grad pass"
                batch = trainer.passes.fixed_logprobs(batch)
                trace.phase = "update"
                trainer.update(batch, trainer.passes.step_normalizer(batch.mask), batch.mask, PhaseTimer())
                trace.phase = "between steps"
                del batch
    out = report(args, res, shapes, est, prompt, trace, stubs, trainer)
    out["seconds"] = round(time.time() - t0, 1)
    print(f"{out['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    return out


# ------------------------------------------------------------------------------------- the fake step
def build_policy(config, p, torch):
    """The policy as ``grpo.model.lora_policy.load_policy`` builds it, on fake "cuda" tensors: the base in the
    compute dtype, its linears in NF4 (bitsandbytes' own fake quantize op) unless the params say
    ``quantization: none``, then ``attach_lora``."""
    from transformers import AutoModelForCausalLM
    from transformers.quantizers.base import get_keys_to_not_convert

    from grpo.core.device import compute_dtype
    from grpo.model.lora_policy import attach_lora
    from grpo.model.nf4_layers import keep_standard_nf4_layout
    from grpo.tools.synthetic import char_tokenizer

    dtype = compute_dtype(p.model.dtype, "cuda")
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    if p.model.quantization == "nf4":
        quantize_nf4(model, set(get_keys_to_not_convert(model)), dtype, torch)
        keep_standard_nf4_layout(model)
        model.is_loaded_in_4bit = True  # as transformers marks a bitsandbytes 4-bit model (peft reads it)
    with torch.device("cuda"):
        model = attach_lora(model, p.lora, p.model.gradient_checkpointing)
    return model, char_tokenizer()


def quantize_nf4(model, skip: set[str], dtype, torch) -> None:
    """Swap every linear that bitsandbytes quantises for a ``Linear4bit`` holding NF4 data from
    ``bitsandbytes.functional.quantize_4bit`` (``Params4bit`` cannot wrap a fake tensor: a plain
    parameter carries the attributes its forward reads)."""
    import bitsandbytes as bnb
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from grpo.tools.memory import NF4_BLOCK

    for name, child in list(model.named_modules()):
        if not isinstance(child, torch.nn.Linear) or any(name == s or name.startswith(s + ".") for s in skip):
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        with unset_fake_temporarily():  # the module shell on meta, outside the fake mode
            q = bnb.nn.Linear4bit(child.in_features, child.out_features, bias=child.bias is not None,
                                  compute_dtype=dtype, compress_statistics=True, quant_type="nf4", device="meta")
        packed, state = bnb.functional.quantize_4bit(child.weight.data, blocksize=NF4_BLOCK,
                                                     compress_statistics=True, quant_type="nf4")
        w = torch.nn.Parameter(packed, requires_grad=False)
        w.quant_state, w.bnb_quantized, w.quant_type, w.blocksize = state, True, "nf4", NF4_BLOCK
        w.compress_statistics, w.quant_storage, w.module = True, torch.uint8, q
        q.weight, q.quant_state = w, state
        if child.bias is not None:
            q.bias = torch.nn.Parameter(child.bias.data, requires_grad=False)
        setattr(parent, name.rsplit(".", 1)[-1], q)


def resident_tensors(model) -> list:
    """Every tensor the model holds before the step: parameters, buffers, NF4 quantisation state."""
    out = list(model.parameters()) + list(model.buffers())
    for module in model.modules():
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            out += [state.absmax, state.code]
            if state.nested:
                out += [state.offset, state.state2.absmax, state.state2.code]
    return out


def given_policy(model, tok):
    """The train stage's ``grpo.training.trainer_builder.TrainerBuilder`` with this bench's policy and
    tokenizer (built here on the fake device: not loaded, and no seed is set for them)."""
    from grpo.training.trainer_builder import TrainerBuilder

    class GivenPolicy(TrainerBuilder):
        def tokenizer(self):
            return tok

        def policy(self):
            return model

    return GivenPolicy


def make_trainer(model, tok, p, prompt: int, out_dir: str, torch):
    """The real ``GRPOTrainer`` (its passes, updater and schedule) and a function that makes one
    step's ``TrainBatch`` from random rollouts (the rollout phase replaced)."""
    from grpo.core.types import Rollout, TrainBatch
    from grpo.rollout.rollout_backends import TransformersBackend
    from grpo.training.trainer_builder import depart

    class Replaced(given_policy(model, tok)):  # no engine starts: the rollout phase is replaced
        def backend(self, tokenizer, model, bounds):
            return TransformersBackend(model, tokenizer)

    # the params' trainer, but for its folder and no checkpoints
    params = depart(p, {"train.output_dir": out_dir, "train.checkpoints.every": 0})
    problems = [{"id": "p0", "question": "1+1", "answer": "2", "solution": ""}]
    trainer = Replaced(params, "cuda").build(problems).trainer
    cfg = trainer.cfg
    n, c = cfg.rollouts.prompts_per_step * cfg.rollouts.group_size, cfg.rollouts.max_new_tokens
    engine = cfg.rollouts.backend != "transformers"

    def batch_of():
        vocab = model.config.vocab_size
        rollout = Rollout(torch.randint(vocab, (n, prompt)), torch.ones(n, prompt, dtype=torch.long),
                          torch.randint(vocab, (n, c)), torch.ones(n, c, dtype=torch.long), [""] * n,
                          torch.zeros(n, c) if engine else None)
        return TrainBatch.from_rollout(rollout, torch.zeros(n), trainer.device)

    return trainer, batch_of


def instrument(trainer, trace) -> None:
    """Name the phases: the no-grad passes, each micro-batch's forward+backward, the optimizer step."""
    passes = trainer.passes

    def named(fn, name):
        def run(*a, **k):
            before, trace.phase = trace.phase, name() if callable(name) else name
            try:
                return fn(*a, **k)
            finally:
                trace.phase = before
        return run

    counter = {"update": 0, "micro": 0}
    mu = trainer.cfg.optimizer.mu

    def micro_name():
        counter["micro"] += 1
        of_mu = f" (update {counter['update']} of mu {mu})" if mu > 1 else ""
        return f"micro-batch {counter['micro']} forward+backward{of_mu}"

    accumulate = passes.accumulate_gradients

    def accumulate_counted(*a, **k):
        counter.update(update=counter["update"] + 1, micro=0)
        return accumulate(*a, **k)

    passes.accumulate_gradients = accumulate_counted
    passes.no_grad_pass = named(passes.no_grad_pass, "no-grad pass")
    passes.loss_backward = named(passes.loss_backward, micro_name)
    trainer.updater.step = named(trainer.updater.step, "optimizer step")
    trace.on_reset.append(lambda: counter.update(update=0, micro=0))


# ------------------------------------------------------------------------------------- the report
def compare(traced: int, estimated: int | None) -> dict:
    row = {"traced_bytes": traced, "estimate_bytes": estimated}
    if estimated:
        row["ratio"] = round(traced / estimated, 4)
    return row


def report(args, res, shapes, est, prompt, trace, stubs, trainer) -> dict:
    """The traced step against the estimate ``est`` of the params ``res.params``, printed and as the
    JSON record (its ``seconds`` added by the caller)."""
    from grpo.tools.memory import gib
    from grpo.training.passes import micro_slices

    p = res.params
    terms = {t.name: t.bytes for t in est.terms}
    n_lora = sum(x.numel() for x in trainer.params)
    resident_est = terms["weights"] + terms["LoRA + AdamW"] - 4 * n_lora  # no gradient between steps
    phases = {"resident": compare(trace.resident, resident_est)}
    for name, peak in trace.phase_peak.items():
        if name in ("between steps", "update"):  # the update outside its named phases: small tensors
            continue
        if name == "optimizer step":
            phases[name] = compare(peak, est.total("both"))
        elif name.startswith("micro-batch"):
            phases[name] = compare(peak, est.total("train"))
        else:
            phases[name] = compare(peak, None)
    groups: dict[str, list[int]] = {}
    for phase, op, shape, dtype, nbytes in trace.snap:
        key = "resident: weights, quantisation state, LoRA, AdamW moments" if phase == "resident" else \
            f"{phase}: {op} {dtype} {'x'.join(map(str, shape))}"
        g = groups.setdefault(key, [0, 0])
        g[0] += 1
        g[1] += nbytes
    top = sorted(groups.items(), key=lambda kv: -kv[1][1])[: args.top]
    t = p.train
    n = t.rollouts.prompts_per_step * t.rollouts.group_size
    out = {
        "params": args.params, "model": shapes.source, "dtype": est.dtype,
        "shape": {"rows": n, "prompt_tokens": prompt, "completion_tokens": t.rollouts.max_new_tokens,
                  "micro_batches": len(micro_slices(n, t.passes.micro_batches, t.rollouts.group_size)),
                  "quantization": p.model.quantization, "gradient_checkpointing": p.model.gradient_checkpointing,
                  "lora_params": n_lora, "mu": t.optimizer.mu, "beta": t.loss.beta, "entropy_top_quantile": t.loss.rule_options().top_quantile},
        "phases": phases,
        "peak": {**compare(trace.peak, est.total("train")), "phase": trace.peak_phase},
        "live_at_peak": [{"what": k, "count": c, "bytes": b} for k, (c, b) in top],
        "replaced": REPLACED, "stub_hits": stubs.hits, "not_counted": NOT_COUNTED,
    }
    print(f"{args.params}: {shapes.source}; {est.dtype}, {p.model.quantization}, gradient checkpointing "
          f"{p.model.gradient_checkpointing}, LoRA {n_lora / 1e6:.2f} M")
    print(f"shape: {n} rows, prompt {prompt} + {t.rollouts.max_new_tokens} tokens, {out['shape']['micro_batches']} micro-batches, "
          f"mu {t.optimizer.mu}, beta {t.loss.beta:g}, entropy top {t.loss.rule_options().top_quantile:g}")
    print(f"  {'phase (live CUDA tensors, the second step)':<58}{'traced':>11}{'estimate':>11}  ratio")
    for name, row in {**phases, "peak (" + trace.peak_phase + ")": out["peak"]}.items():
        e = row["estimate_bytes"]
        print(f"  {name:<58}{gib(row['traced_bytes']):>11}{gib(e) if e else '-':>11}  {row.get('ratio', '')}")
    print("  estimate: resident = weights + LoRA (param and 2 moments); micro-batches and peak = the training "
          "total; optimizer step = weights + LoRA x 16 B; the no-grad passes have no term of their own")
    print(f"live at the peak ({gib(trace.peak)}), largest groups:")
    for item in out["live_at_peak"]:
        print(f"  {item['bytes'] / MiB:9.1f} MiB  {item['count']:4d} x  {item['what']}")
    print("replaced: " + "; ".join(REPLACED))
    print(f"data-dependent answers given: {stubs.hits}")
    print(f"not counted: {NOT_COUNTED}")
    return out


# ------------------------------------------------------------------------------------- --all
DECODE_LOOP = {"sent.backend": "transformers", "evaluate.backend": "transformers",
               "train.rollouts.backend": "transformers"}
"""``--all``'s departures: the decode loop samples (no vLLM can run on fake tensors, nor be carried to a card)."""


def main_all(args) -> dict:
    """Every CUDA call of the stages (module docstring): trace, prediction, cap, context."""
    fake_cuda.load()
    import torch
    from fake_cuda import calls as stage_calls
    from fake_cuda.trace import DataDependent, LiveBytes, patch_torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    from grpo.rollout.sampling import compiled_steps
    from grpo.tools import memory
    from grpo.training.trainer_builder import depart, departure_line

    t0 = time.time()
    res, config, source, prompt = resolve_run(args.params, args.prompt_tokens)
    p = depart(res.params, DECODE_LOOP)
    shapes = memory.model_shapes(config, source)
    context_gib = args.context_gib
    if context_gib is None:
        context_gib = json.loads((Path(__file__).resolve().parents[1] / CONTEXT_FILE).read_text())["context"][
            "outside_forward_gib"]
    card, context = int(args.cap_gib * GiB), int(context_gib * GiB)
    wanted = [c for c in args.calls.split(",") if c]
    unknown = sorted(set(wanted) - set(CALLS))
    if unknown:
        raise SystemExit(f"--calls: unknown {', '.join(unknown)} (of {', '.join(CALLS)})")
    print(f"{args.params}: {source}; departures: {departure_line(DECODE_LOOP)}; prompt {prompt} tokens; "
          f"card {args.cap_gib:g} GiB, CUDA context {context_gib:g} GiB")
    patch_torch()
    stubs = DataDependent(p.train.loss.rule_options().top_quantile)
    out = {"params": args.params, "model": str(source), "prompt_tokens": prompt, "departures": DECODE_LOOP,
           "calls": {}, "replaced": REPLACED + stage_calls.REPLACED, "not_counted": NOT_COUNTED_ALL}
    stage_prompts = {"sent": p.data.train_size, "evaluation": p.data.test_size}
    for name in wanted:
        with FakeTensorMode(allow_non_fake_inputs=True), stubs, stage_calls.full_length_decoding(stubs):
            if name == "train_step":
                with tempfile.TemporaryDirectory() as out_dir:
                    model, _ = build_policy(config, p, torch)
                    tok = stage_calls.tokenizer()
                    trace = LiveBytes(resident_tensors(model))
                    with trace, stage_calls.on_a_card(trace, card, context), stage_calls.eager_compile(trace):
                        trainer = step_trainer(model, tok, p, out_dir)
                        what = stage_calls.train_step(trace, trainer, tok, p, prompt,
                                                      min(args.val_prompts, p.data.val_size))
                        trainer.backend.close()
                        what["released"] = not compiled_steps(model)
                predicted = memory.estimate(p, shapes, "cuda", prompt)
                what["predicted_phase"] = predicted.peak_phase
                predicted = predicted.peak
            else:
                section = "sent" if name == "sent" else "evaluate"
                trace, what = stage_calls.saved_model_call(p, config, section, prompt, stage_prompts[name], card, context)
                call = memory.decode_call(p, shapes, "cuda", section, prompt, card, context, stage_prompts[name])
                predicted = call.need
                what["predicted_per_call"], what["predicted_shape"] = call.per_call, str(call.compiled)
        row = {"traced_gib": round(trace.peak / GiB, 4), "predicted_gib": round(predicted / GiB, 4),
               "cap_gib": args.cap_gib, "context_gib": context_gib, "traced_bytes": trace.peak,
               "predicted_bytes": predicted, "peak_phase": trace.peak_phase,
               "phases": {k: round(v / GiB, 4) for k, v in trace.phase_peak.items()},
               "resident_gib": round(trace.resident / GiB, 4), **what,
               "live_at_peak": top_groups(trace.snap, args.top)}
        row["fits"] = trace.peak <= predicted <= card - context
        out["calls"][name] = row
        print_call(name, row)
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    out["seconds"] = round(time.time() - t0, 1)
    print("replaced: " + "; ".join(out["replaced"]))
    print(f"not counted: {NOT_COUNTED_ALL}")
    print(f"data-dependent answers given: {stubs.hits}")
    print(f"{out['seconds']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str) + "\n")
    return out


NOT_COUNTED_ALL = ("kernel scratch, cuBLAS workspaces, fragmentation, torch.compile's own workspaces "
                   "(the graph pool is a stand-in: one eager step's transient peak), the dense export before an "
                   "evaluation, vLLM")


def top_groups(snap, top: int) -> list[dict]:
    """The ``top`` largest groups of live tensors in a trace's snapshot at its peak."""
    groups: dict[str, list[int]] = {}
    for phase, op, shape, dtype, nbytes in snap:
        key = "resident" if phase == "resident" else f"{phase}: {op} {dtype} {'x'.join(map(str, shape))}"
        g = groups.setdefault(key, [0, 0])
        g[0], g[1] = g[0] + 1, g[1] + nbytes
    return [{"what": k, "count": c, "mib": round(b / MiB, 1)}
            for k, (c, b) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]]


def step_trainer(model, tok, p, out_dir: str):
    """The train stage's trainer as ``TrainerBuilder`` makes it (its own decode-loop backend,
    completions at full length), in ``out_dir``, no checkpoints."""
    from grpo.training.trainer_builder import depart

    class FullLength(given_policy(model, tok)):
        def rollout_lengths(self) -> tuple[int | None, int]:
            return None, p.train.rollouts.max_new_tokens

    params = depart(p, {"train.output_dir": out_dir, "train.checkpoints.every": 0})
    problems = [{"id": "p0", "question": "1+1", "answer": "2", "solution": ""}]
    return FullLength(params, "cuda").build(problems).trainer


def print_call(name: str, row: dict) -> None:
    cap = row["cap_gib"] - row["context_gib"]
    print(f"  {name:<11} traced {row['traced_gib']:.3f} GiB <= predicted {row['predicted_gib']:.3f} GiB <= cap "
          f"{row['cap_gib']:g} - context {row['context_gib']:g} = {cap:.3f} GiB: {'yes' if row['fits'] else 'NO'}"
          f" (peak in {row['peak_phase']})")
    for phase, gib_ in row["phases"].items():
        print(f"      {phase:<40}{gib_:8.3f} GiB")
    for item in row["live_at_peak"]:
        print(f"      {item['mib']:9.1f} MiB {item['count']:4d} x {item['what']}")
    extra = {k: v for k, v in row.items() if k not in ("phases", "live_at_peak", "traced_gib", "predicted_gib", "cap_gib",
                                                        "context_gib", "traced_bytes", "predicted_bytes", "fits",
                                                        "peak_phase")}
    print("      " + ", ".join(f"{k} {v}" for k, v in extra.items()))


if __name__ == "__main__":
    main()
