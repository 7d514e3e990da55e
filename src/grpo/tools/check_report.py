"""What ``grpo check`` prints after the params resolved, and what ``grpo doctor --params`` holds free
memory to: the half of those commands that needs torch (``grpo.tools.cli`` is the other half).

Contract. ``grpo.tools.cli`` resolves and validates the params file first (``resolve_params``: a bad
file is one line before torch loads), then imports this module and hands over the ``Resolved``
params:

* ``check(res, device, gpu_memory, prompt_tokens)`` prints ``grpo check``'s report and returns its
  exit code (0): the settings (``settings_lines``), the splits at the data source's real sizes
  (``grpo.data.split_check.check_params``: a split that would be empty or short raises ``ParamsError``
  before anything is printed), the device, the stages ``dvc repro`` would run
  (``grpo.tools.dvcstatus``), what samples the rollouts (``decode_line``, ``rollouts_line``) and one
  training step's memory (``grpo.tools.memory``); on CUDA the saved-model engines'
  (``saved_model_plans``), a verdict per stage for a card of known size (``stage_verdicts``) and the
  modelled times (``grpo.tools.timing``). ``device`` None: this machine's (``default_device``, which
  raises ``DeviceError`` on a CUDA build without a usable GPU, after the device line);
  ``prompt_tokens`` None: the longest training prompt where data and tokenizer exist, else
  ``DEFAULT_PROMPT_TOKENS``.
* ``stage_needs(p, root, card)``: what each stage needs free on a card of ``card`` bytes, the figure
  ``grpo doctor --params`` compares free memory with.

Nothing here reads argv or exits: the arguments are the command's options, already checked.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from grpo.algorithm.curriculum import num_stages_of
from grpo.config.reading import Params
from grpo.core.device import default_device, describe_device
from grpo.data.split_check import check_params
from grpo.rollout.engine import needs
from grpo.rollout.engine.bounds import SAVED_MODEL_SEQS
from grpo.rollout.engine.forms import rollouts_per_process
from grpo.rollout.rollout_backends import uses_engine
from grpo.rollout.sampling import plan_decode
from grpo.tools import dvcstatus, memory
from grpo.tools.timing import format_times

if TYPE_CHECKING:
    from grpo.tools.cli import Resolved

DEFAULT_PROMPT_TOKENS = 128
"""The prompt length the estimates take where no prompt can be measured (``--prompt-tokens`` sets one)."""


def _g(x: float) -> str:
    return f"{x:g}"


def settings_lines(p: Params) -> list[str]:
    """The main knobs, one line per section."""
    d, m, lo, s, e, t = p.data, p.model, p.lora, p.sent, p.evaluate, p.train
    source = f"jsonl {d.path}" if d.source == "jsonl" else d.source
    gen = f"{t.rollouts.generation_batch_size} completions" if t.rollouts.generation_batch_size else "whole step"
    rewards = ", ".join(f"{k} {_g(v)}" for k, v in t.rewards.items())
    eps, eps_high = t.loss.clip()
    clip = _g(eps) + (f"/{_g(eps_high)}" if eps_high != eps else "")
    return [
        f"  data      {source}, {d.train_size} train / {d.test_size} test / {d.val_size} validation -> {d.out_dir}",
        f"  model     {m.name} -> {m.path}, {m.quantization}, dtype {m.dtype}, gradient checkpointing "
        f"{'on' if m.gradient_checkpointing else 'off'}",
        f"  lora      r{lo.rank} alpha {_g(lo.alpha)} dropout {_g(lo.dropout)} on {', '.join(lo.target_modules)}",
        f"  sent      {s.backend}, M={s.num_samples}, <= {s.max_new_tokens} tokens, T={_g(s.temperature)}, "
        f"{s.estimator}",
        f"  train     {t.order} ({num_stages_of(t)} stages), {t.steps} steps x {t.rollouts.prompts_per_step} prompts x "
        f"G={t.rollouts.group_size}, <= {t.rollouts.max_new_tokens} new tokens, T={_g(t.rollouts.temperature)}, lr {_g(t.optimizer.lr)} {t.optimizer.lr_schedule} "
        f"(warm-up {t.optimizer.warmup_steps}), {t.loss.loss_type}, beta {_g(t.loss.beta)}, clip {clip}, mu {t.optimizer.mu}",
        f"            entropy top {_g(t.loss.rule_options().top_quantile)}, micro-batches {t.passes.micro_batches}, generation "
        f"batch {gen}, kernel {t.passes.kernel}, rewards {rewards}",
        f"  evaluate  {e.backend}, greedy, <= {e.max_new_tokens} tokens on {e.test_path}",
    ]


# ------------------------------------------------------------------------------------- check
def check(res: Resolved, device: str | None, gpu_memory: float | None, prompt_tokens: int | None) -> int:
    """``grpo check``'s report for the resolved params ``res`` (the module docstring)."""
    p = res.params
    splits = check_params(p, res.root)  # a split that would be empty or short stops here, before the estimate
    print("\n".join(header_lines(res, splits, device)))
    device = device or default_device()
    engine = uses_engine(p.train.rollouts.backend)  # the train stage's rule
    print(f"decode: {decode_line(p, device, engine)}")
    shapes = memory.resolve_shapes(p.model, res.root)
    if isinstance(shapes, str):
        known = not (device == "cuda" and p.train.rollouts.engine_weights == "auto")  # auto on CUDA needs the shapes
        form = needs.choose_engine_form(p, None, device, 0, None)[0] if engine and known else "auto"
        print(f"rollouts: {rollouts_line(p, engine, form)}")
        print(f"memory: no estimate: {shapes}")
        return 0
    prompt = prompt_for(p, res.root, prompt_tokens)
    card = card_bytes(gpu_memory, device)
    plan = needs.engine_plan(p, shapes, device, prompt[0], card[0]) if engine and device == "cuda" else None
    est = training_estimate(p, shapes, device, prompt, card, plan)
    if device != "cuda":
        return 0
    saved = saved_model_plans(p, res.root, shapes, device, prompt, bool(prompt_tokens), card[0])
    if card[0] is not None:
        print("\n".join(stage_verdicts(p, shapes, device, prompt[0], card[0], saved, plan, est)))
    print("\n".join(format_times(p, shapes, prompt[0])))
    return 0


def header_lines(res: Resolved, splits: list[str], device: str | None) -> list[str]:
    """The report's first lines: the params, their settings and splits, the device, the DVC status."""
    here = describe_device()
    return [f"params: {res.label}: valid", *settings_lines(res.params),
            *(f"  {'splits' if i == 0 else '':<10}{line}" for i, line in enumerate(splits)),
            f"device: estimating for {device} (--device); this machine: {here}" if device
            else f"device: estimating for this machine: {here}",
            *dvcstatus.describe(res.root, res.changed)]


def prompt_for(p: Params, root: Path, given: int | None) -> tuple[int, str]:
    """The prompt tokens of the estimate and where they came from: ``given`` (``--prompt-tokens``),
    else the longest training prompt, else ``DEFAULT_PROMPT_TOKENS``."""
    if given:
        return given, "--prompt-tokens"
    found = needs.longest_prompt_tokens(p, root)
    return found if found else (DEFAULT_PROMPT_TOKENS, "assumed; --prompt-tokens N to set")


def training_estimate(p: Params, shapes, device: str, prompt: tuple[int, str], card: tuple[int | None, str],
                      plan) -> memory.Estimate:
    """Print one training step's estimate on ``device`` (rollouts from ``plan``'s engine, or the
    decode loop where ``plan`` is None) and return it."""
    engine = uses_engine(p.train.rollouts.backend)
    form = plan.form if plan else (needs.choose_engine_form(p, shapes, device, prompt[0], card[0])[0] if engine else None)
    est = memory.estimate(p, shapes, device, prompt[0], engine=plan)
    s, r = shapes, p.train.rollouts
    print(f"memory: one training step on {device} ({est.dtype} compute), estimated")
    print(f"  model: {s.source}: {s.total_params / 1e9:.3g} B params, {s.layers} layers, hidden {s.hidden}, "
          f"intermediate {s.intermediate}, {s.heads} heads / {s.kv_heads} kv heads x {s.head_dim}, vocab {s.vocab}")
    print(f"  shape: {r.prompts_per_step} prompts x G={r.group_size}, prompt {prompt[0]} tokens ({prompt[1]}) "
          f"+ {r.max_new_tokens} new tokens (all full length)")
    print(f"  card: {card[1]}")
    print(f"  rollouts: {rollouts_line(p, engine, form)}")
    if plan is not None:
        print(f"  engine: train.rollouts.engine_weights {r.engine_weights} -> {plan.form} ({plan.why}); max_num_seqs "
              f"{plan.seqs}, max_num_batched_tokens {plan.batched_tokens}, enforce_eager")
        print("\n".join(f"  {line}" for line in memory.format_engine(plan, shapes)))
    print("\n".join(memory.format_table(est)))
    for line in memory.measured_for(p, shapes, device, prompt[0]):
        print(f"  {line}")
    return est


def stage_verdicts(p: Params, shapes, device: str, prompt: int, card: int, saved: dict, plan, est) -> list[str]:
    """``grpo check``'s verdict per stage on a card of ``card`` bytes: each saved-model engine's
    (``saved``: ``saved_model_plans``' result) and the train stage's (``plan``, ``est``)."""
    lines = ["verdict per stage:"]
    for section, stages in memory.SAVED_MODEL_STAGES:
        call = memory.decode_call(p, shapes, device, section, prompt, card,
                                  stage_prompts=p.data.train_size if section == "sent" else p.data.test_size)
        loop = memory.decode_call_verdict(call, card)
        if section not in saved:
            lines.append(f"  {', '.join(stages)}: {loop}")
            continue
        saved_plan, saved_prompt = saved[section]
        lines.append(f"  {', '.join(stages)}: {memory.saved_model_verdict(p, shapes, device, saved_plan, saved_prompt)}")
        lines.append(f"    without vLLM (GRPO_NO_VLLM=1, or no vLLM for this torch): {loop}")
    others = needs.other_plans(p, shapes, device, prompt, plan) if plan is not None else []  # the advice's other forms
    rule = f"train.loss.entropy_rule {p.train.loss.entropy_rule} (top_quantile {p.train.loss.rule_options().top_quantile})"
    lines.append(f"  train: {memory.verdict(p, est, card, plan, others)}; estimated for {rule}")
    return lines


def saved_model_plans(p: Params, root: Path, shapes, device: str, prompt: tuple[int, str], given: bool,
                      card: int | None) -> dict:
    """Print the arithmetic of the saved-model engines (SENT's, the evaluations') that the stages
    would start (``grpo.rollout.rollout_backends.uses_engine`` of the section's backend), and return them by section
    as ``(plan, prompt tokens)``. SENT's prompts are the training prompts (``prompt``); the
    evaluations' the longest of ``evaluate.test_path`` where it can be measured, else ``prompt``
    (``given``: ``--prompt-tokens``, for every stage)."""
    out = {}
    for section, stages in memory.SAVED_MODEL_STAGES:
        if not uses_engine(getattr(p, section).backend):
            continue
        tokens, how = prompt
        if section == "evaluate" and not given:
            found = needs.longest_prompt_tokens(p, root, (p.evaluate.test_path,))
            tokens, how = found if found else (tokens, f"as the training step's: {how}")
        plan = memory.saved_model_needs(p, shapes, device, section, tokens, card)
        if not out:
            print(f"memory: the saved-model engines on {device}, one generation call each, estimated")
        what = "the base" if section == "sent" else "the policy exported dense"
        print(f"  {', '.join(stages)}: {what} in {plan.dtype}; max_num_seqs {plan.seqs} ({plan.why}, at most "
              f"vLLM's {SAVED_MODEL_SEQS}), max_num_batched_tokens {plan.batched_tokens} (vLLM's default), prompt "
              f"{tokens} tokens ({how}) + {getattr(p, section).max_new_tokens} new tokens")
        print("\n".join(f"  {line}" for line in memory.format_engine(plan, shapes)))
        out[section] = (plan, tokens)
    return out


def decode_line(p: Params, device: str, engine: bool) -> str:
    """What ``decode.*`` picks on ``device`` (``grpo.rollout.sampling.plan_decode``) for training's rollouts
    (when no engine samples them), and the rule SENT and the evaluations apply at their start."""
    try:
        train = plan_decode(p.decode, device, p.train.steps * p.train.rollouts.max_new_tokens).why
    except ValueError as err:
        return f"error: {err}"
    train = "a vLLM engine samples (train.rollouts.backend)" if engine else train
    return (f"train: {train}; sent and evaluate (where the decode loop samples): the same rule, with their own "
            "token steps (rows / batch_prompts x max_new_tokens), logged at their start")


def rollouts_line(p: Params, engine: bool, form: str | None) -> str:
    """What each training process samples with, as the train stage logs it (``rollouts_per_process``)."""
    return f"{rollouts_per_process(engine, p.train.distribution.num_processes, form)} (train.rollouts.backend {p.train.rollouts.backend})"


def card_bytes(gpu_memory: float | None, device: str) -> tuple[int | None, str]:
    """The card's total memory in bytes (``--gpu-memory`` GiB, else this machine's card on CUDA) and
    where it came from."""
    if device != "cuda":
        return None, "none (a CPU estimate)" + (": --gpu-memory applies to --device cuda" if gpu_memory else "")
    if gpu_memory is not None:
        return int(gpu_memory * 2**30), f"{gpu_memory:g} GiB (--gpu-memory)"
    if torch.cuda.is_available():
        total = torch.cuda.mem_get_info()[1]
        return total, f"{total / 2**30:.2f} GiB (this machine's)"
    return None, "unknown: --gpu-memory GIB for the engine's budget and a verdict"


# ------------------------------------------------------------------------------------- doctor
def stage_needs(p: Params, root: Path, card: int) -> dict[str, int]:
    """What each stage needs free on a card of ``card`` bytes, as this process measures free memory
    (its own CUDA context already taken): a saved-model engine (SENT, the evaluations) its
    ``gpu_memory_utilization x card``, below which vLLM refuses to start, plus the CUDA contexts
    beside it beyond one (``grpo.tools.memory.saved_model_contexts``, as ``grpo check``'s verdict); the
    train stage the estimated peak of one step (``grpo check``'s). Empty where the model's shapes
    are unknown."""
    shapes = memory.resolve_shapes(p.model, root)
    if isinstance(shapes, str):
        return {}
    out = {", ".join(stages): int(getattr(p, section).gpu_memory_utilization * card)
           + (memory.saved_model_contexts(section) - 1) * memory.CUDA_CONTEXT
           for section, stages in memory.SAVED_MODEL_STAGES if uses_engine(getattr(p, section).backend)}
    found = needs.longest_prompt_tokens(p, root)
    prompt = found[0] if found else DEFAULT_PROMPT_TOKENS
    plan = needs.engine_plan(p, shapes, "cuda", prompt, card) if uses_engine(p.train.rollouts.backend) else None
    out["train"] = memory.estimate(p, shapes, "cuda", prompt, engine=plan).peak
    return out
