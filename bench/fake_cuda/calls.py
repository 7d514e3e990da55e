"""The CUDA calls of the stages, traced on fake CUDA tensors (``bench/cuda_memory.py --all``;
import after ``fake_cuda.load()``).

``on_a_card``: the 8 GB card as the code sees it (``torch.cuda.mem_get_info``: the card less the
CUDA context less the live traced bytes; the allocator's reserved and allocated figures the live
bytes), so ``grpo.rollout.decode_memory.allocator_budget`` splits calls as it would there. ``EagerStep``:
what ``torch.compile`` returns here (a compiled step cannot run on fake tensors): the step runs
eagerly, and between its calls a stand-in of its CUDA graph's pool stays allocated, as large as
the step's eager transient peak (a graph replays its transients at fixed addresses in a private
pool that stays). ``sent_call``, ``evaluation_call``, ``train_step``: each stage's call through
the stage's own objects (``TransformersBackend`` as ``saved_model_sampler`` builds it, the stage's
``generate_in_batches``; the train stage's ``build_trainer``, its rollouts, no-grad passes, update
and validation's ``generate``).
"""

from __future__ import annotations

import contextlib
import gc

import torch

REPLACED = [
    "the saved model: built from its config on the fake device (saved_model_sampler loads it from disk); "
    "the tokenizer: characters, each prompt exactly the prompt tokens long",
    "decode loops: every row ends at the loop's first check (check_every tokens: the static loop's shapes are fixed, "
    "so its later steps allocate as these did), every completion full length",
    "the compiled step: run eagerly (torch.compile cannot run on fake tensors); between calls a stand-in of its "
    "CUDA graph's pool stays allocated, as large as one eager step's transient peak",
    "completion texts: empty (a fake tensor has no tokens): rewards and SENT's scoring are left out",
    "validation: GRPOTrainer.validate's generate call alone (its scoring reads values), on --val-prompts problems",
]


@contextlib.contextmanager
def on_a_card(trace, card: int, context: int):
    """``torch.cuda``'s memory readings as a card of ``card`` bytes with ``context`` bytes outside the
    allocator shows them, the traced live bytes allocated (``empty_cache``: nothing to give back)."""
    cuda = torch.cuda
    names = ("mem_get_info", "memory_reserved", "memory_allocated", "get_per_process_memory_fraction",
             "empty_cache", "reset_peak_memory_stats")
    saved = {n: getattr(cuda, n, None) for n in names}
    cuda.mem_get_info = lambda device=None: (card - context - trace.cur, card)
    cuda.memory_reserved = cuda.memory_allocated = lambda device=None: trace.cur
    cuda.get_per_process_memory_fraction = lambda device=None: 1.0
    cuda.empty_cache = cuda.reset_peak_memory_stats = lambda device=None: None
    try:
        yield
    finally:
        for n, fn in saved.items():
            setattr(cuda, n, fn)


class EagerStep:
    """``torch.compile(fn)``'s stand-in (module docstring): ``pool`` holds the graph pool's bytes."""

    def __init__(self, fn, trace):
        self.fn, self.trace, self.pool, self.pool_bytes = fn, trace, None, 0

    def __call__(self, *args):
        self.pool = None  # a replay's transients take the pool's place
        before = self.trace.cur
        self.trace.open_window()
        out = self.fn(*args)
        self.pool_bytes = max(self.pool_bytes, self.trace.window - before)
        self.pool = torch.empty(self.pool_bytes, dtype=torch.uint8, device="cuda")
        return out


@contextlib.contextmanager
def eager_compile(trace):
    """``torch.compile`` -> ``EagerStep``; ``cudagraph_mark_step_begin``: nothing to mark."""
    compile_, mark = torch.compile, torch.compiler.cudagraph_mark_step_begin
    torch.compile = lambda fn, **_: EagerStep(fn, trace)
    torch.compiler.cudagraph_mark_step_begin = lambda: None
    try:
        yield
    finally:
        torch.compile, torch.compiler.cudagraph_mark_step_begin = compile_, mark


@contextlib.contextmanager
def full_length_decoding(stubs):
    """Every ``grpo.rollout.sampling.decode`` call the backends make under ``stubs.decoding`` (module docstring)."""
    import grpo.rollout.rollout_backends as rb

    decode = rb.decode

    def traced(model, ids, mask, num_samples, draw, loop):
        with stubs.decoding(draw.max_new_tokens):
            return decode(model, ids, mask, num_samples, draw, loop)

    rb.decode = traced
    try:
        yield
    finally:
        rb.decode = decode


def tokenizer():
    """The character tokenizer, its texts replaced (module docstring)."""
    from grpo.tools.synthetic import char_tokenizer

    tok = char_tokenizer()
    tok.batch_decode = lambda ids, **_: [""] * len(ids)
    return tok


def prompts_of(tok, system_prompt: str, tokens: int, n: int) -> list[str]:
    """``n`` chat prompts (``grpo.data.sources.build_prompt``) of exactly ``tokens`` tokens each."""
    from grpo.data.sources import build_prompt

    base = len(tok(build_prompt(tok, "", system_prompt), add_special_tokens=False)["input_ids"])
    if tokens < base:
        raise SystemExit(f"--prompt-tokens: at least {base} (the chat template and the system prompt)")
    return [build_prompt(tok, "x" * (tokens - base), system_prompt)] * n


def saved_model(config, dtype):
    """A saved model as ``load_base_model`` gives it (every parameter in ``dtype``), on the fake device."""
    from transformers import AutoModelForCausalLM

    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="sdpa")
    return model.eval()


def stage_sampler(model, tok, params, section: str, stage_prompts: int):
    """The stage's decode-loop sampler, as ``saved_model_sampler`` builds it."""
    from grpo.rollout.rollout_backends import DecodeChoice, TransformersBackend, planned_tokens

    cfg = getattr(params, section)
    return TransformersBackend(model, tok, return_logprobs=True, dequantize=False,
                               decode=DecodeChoice(params.decode, planned_tokens(stage_prompts, cfg)))


def saved_model_call(params, config, section: str, prompt: int, stage_prompts: int, card: int, context: int):
    """SENT's (``section`` sent) or an evaluation's (evaluate) first call of ``batch_prompts``
    prompts through ``generate_in_batches``, as the stage makes it, then the sampler closed:
    (the ``LiveBytes`` trace, what the call did)."""
    from fake_cuda.trace import LiveBytes
    from grpo.rollout.rollout_backends import generate_in_batches
    from grpo.rollout.sampling import compiled_steps
    from grpo.tools.memory import saved_model_dtype

    cfg = getattr(params, section)
    model = saved_model(config, saved_model_dtype(params, section, "cuda"))
    tok = tokenizer()
    trace = LiveBytes(list(model.parameters()) + list(model.buffers()))
    sent = section == "sent"
    samples, sampling = ((cfg.num_samples, dict(temperature=cfg.temperature, top_p=cfg.top_p)) if sent
                         else (1, dict(temperature=0.0)))
    prompts = prompts_of(tok, params.train.system_prompt, prompt, cfg.batch_prompts)
    with trace, on_a_card(trace, card, context), eager_compile(trace):
        sampler = stage_sampler(model, tok, params, section, stage_prompts)
        trace.phase = f"{section} call"
        per_call = sampler.prompts_per_call(len(prompts), samples, prompt, cfg.max_new_tokens, torch.device("cuda"))
        for _ in generate_in_batches(sampler, prompts, samples, batch_prompts=cfg.batch_prompts, progress=False,
                                     max_new_tokens=cfg.max_new_tokens, **sampling):
            pass
        held = sorted(compiled_steps(model))
        trace.phase = "closed"
        kept = trace.cur
        sampler.close()
        gc.collect()  # the cache's reference cycles
    return trace, {"prompts": cfg.batch_prompts, "samples": samples, "prompt_tokens": prompt,
                   "new_tokens": cfg.max_new_tokens, "per_call": per_call, "held_steps": held,
                   "kept_after_call": kept, "after_close": trace.cur, "released": not compiled_steps(model)}


def train_step(trace, trainer, tok, params, prompt: int, val_prompts: int) -> dict:
    """The train stage's step twice (``GRPOTrainer.rollout`` through its own backend, the no-grad
    passes, the update), each followed by validation's generate call; the figures from the second
    step on (AdamW's moments and the compiled step exist then, as at every later step)."""
    from grpo.core.types import TrainBatch
    from grpo.rollout.sampling import compiled_steps
    from grpo.training.metrics import PhaseTimer

    cfg = trainer.cfg
    rows = prompts_of(tok, cfg.system_prompt, prompt, cfg.rollouts.prompts_per_step)
    val = prompts_of(tok, cfg.system_prompt, prompt, val_prompts)
    n = cfg.rollouts.prompts_per_step * cfg.rollouts.group_size
    held = []
    for step in (1, 2):
        if step == 2:
            trace.reset()  # what stays (weights, AdamW's moments, the compiled step, dense copies) is resident now
        trace.phase = "rollouts"
        rollout = trainer.rollout(rows)
        batch = TrainBatch.from_rollout(rollout, torch.zeros(n), trainer.device)
        trace.phase = "no-grad pass"
        batch = trainer.passes.fixed_logprobs(batch)
        trace.phase = "update"
        trainer.update(batch, trainer.passes.step_normalizer(batch.mask), batch.mask, PhaseTimer())
        del batch, rollout
        trace.phase = "validation"
        trainer.sync_backend()
        trainer.backend.generate(val, 1, max_new_tokens=cfg.checkpoints.eval_max_new_tokens, temperature=0.0)
        trainer.backend.sleep()
        trace.phase = "between steps"
        held.append(sorted(compiled_steps(trainer.model)))
    return {"rows": n, "prompt_tokens": prompt, "new_tokens": cfg.rollouts.max_new_tokens,
            "val_prompts": val_prompts, "held_steps": held[-1], "held_after_step_1": held[0]}
