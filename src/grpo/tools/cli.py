"""The ``grpo`` command: ``grpo check``, ``grpo ask`` and ``grpo doctor`` (also ``python -m grpo.tools.cli``;
``grpo --version``).

``grpo check [--params FILE] [--device cpu|cuda] [--gpu-memory GIB]`` validates the params, refuses
splits that would be empty or short at the data source's real sizes or that training would misuse
(``grpo.data.split_check``, one line naming the key, exit code 2), prints the main settings, the splits, the device, the stages ``dvc repro`` would run and an estimate of one training
step's peak memory (``grpo.tools.memory``); on CUDA with engine rollouts, the train engine's arithmetic
and both phases with it, then the arithmetic of SENT's and the evaluations' engines (one generation
call each), and for a card of ``GIB`` total, as the card reports it (else this machine's), a
verdict per stage: whether it fits and, if not, the param to turn. ``grpo ask "QUESTION" [--adapter
DIR]`` answers with the base model or base + LoRA adapter, greedily, streaming the text, then
prints ``answer: N`` (``grpo.tools.ask``). ``grpo doctor [--estimate-gib GIB]`` checks what a first run
on this machine's GPU needs, one line each (ok / warn / BLOCKER, with the fix:
``grpo.rollout.engine.preflight``) and exits 2 naming the blocker where one is found.

Params files. The workspace of ``--params FILE`` is the nearest directory at or above FILE that
holds a ``dvc.yaml`` (else the current directory); relative paths in the params (``model.path``)
are read from there, as the stages read them. FILE may name only some keys (a preset): it is put
over the workspace's ``params.yaml`` key by key, as ``scripts/pipeline.sh FILE`` does before
``dvc repro``, so ``grpo check --params presets/seed003.yaml`` shows the run that command starts.
A complete file (every key) is itself. A bad file stops with one line naming the field, exit code 2.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

from grpo.config.overlay import overlay_params
from grpo.config.params import params_from_dict
from grpo.config.reading import Params, read_params_yaml
from grpo.core.dvcfile import find_root
from grpo.core.errors import DeviceError, ModelConfigError, ParamsError
from grpo.core.jsonio import DataError
from grpo.rollout.engine.bounds import SAVED_MODEL_SEQS
from grpo.tools.timing import format_times

DEFAULT_PROMPT_TOKENS = 128


@dataclass
class Resolved:
    params: Params
    root: Path  # the workspace: relative paths in the params are read from here
    label: str  # how the params were put together, for the first line of `check`
    changed: list[str] = field(default_factory=list)  # keys that differ from the workspace's params.yaml


def workspace_root(path: Path) -> Path:
    """The workspace of the params file ``path``: the nearest directory above it holding a ``dvc.yaml``
    (``grpo.core.dvcfile.find_root``), else the current directory."""
    return find_root(path.resolve().parent) or Path.cwd()


def resolve_params(path: str | Path) -> Resolved:
    """Validated params of ``path`` (a preset put over its workspace's ``params.yaml``, see above)."""
    path = Path(path)
    if not path.is_file():
        raise ParamsError(f"{path}: params file not found")
    root = workspace_root(path)
    base_path = root / "params.yaml"
    raw = read_params_yaml(path)
    try:
        alone = params_from_dict(raw)  # the file's own keys and values, over the defaults
    except ParamsError as err:
        raise ParamsError(f"{path}: {err}") from None
    if not base_path.is_file() or base_path.resolve() == path.resolve():
        return Resolved(alone, root, str(path))
    base = read_params_yaml(base_path)
    try:
        params = params_from_dict(overlay_params(base, raw))
        before = params_from_dict(base)
    except ParamsError as err:
        raise ParamsError(f"{path} over {base_path}: {err}") from None
    from grpo.tools.dvcstatus import flat_keys

    new, old = flat_keys(params.model_dump()), flat_keys(before.model_dump())
    changed = [k for k in new if new[k] != old.get(k)]
    return Resolved(params, root, f"{path} put over {base_path}", changed)


# ------------------------------------------------------------------------------------- check
def _g(x: float) -> str:
    return f"{x:g}"


def settings_lines(p: Params) -> list[str]:
    """The main knobs, one line per section."""
    from grpo.algorithm.curriculum import num_stages_of

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


def cmd_check(args) -> int:
    res = resolve_params(args.params)  # before torch is imported: a bad file fails in a second
    p = res.params
    from grpo.core.device import default_device, describe_device
    from grpo.data.split_check import check_params
    from grpo.rollout.engine import needs
    from grpo.rollout.rollout_backends import uses_engine
    from grpo.tools import dvcstatus, memory

    splits = check_params(p, res.root)  # a split that would be empty or short stops here, before the estimate
    print(f"params: {res.label}: valid")
    print("\n".join(settings_lines(p)))
    print("\n".join(f"  {'splits' if i == 0 else '':<10}{line}" for i, line in enumerate(splits)))
    here = describe_device()
    print(f"device: estimating for {args.device} (--device); this machine: {here}" if args.device
          else f"device: estimating for this machine: {here}")
    print("\n".join(dvcstatus.describe(res.root, res.changed)))

    device = args.device or default_device()
    engine = uses_engine(p.train.rollouts.backend)  # the train stage's rule
    print(f"decode: {decode_line(p, device, engine)}")
    shapes = memory.resolve_shapes(p.model, res.root)
    if isinstance(shapes, str):
        known = not (device == "cuda" and p.train.rollouts.engine_weights == "auto")  # auto on CUDA needs the shapes
        form = needs.choose_engine_form(p, None, device, 0, None)[0] if engine and known else "auto"
        print(f"rollouts: {rollouts_line(p, engine, form)}")
        print(f"memory: no estimate: {shapes}")
        return 0
    if args.prompt_tokens:
        prompt, how = args.prompt_tokens, "--prompt-tokens"
    else:
        found = needs.longest_prompt_tokens(p, res.root)
        prompt, how = found if found else (DEFAULT_PROMPT_TOKENS, "assumed; --prompt-tokens N to set")
    card, card_how = card_bytes(args.gpu_memory, device)
    plan = needs.engine_plan(p, shapes, device, prompt, card) if engine and device == "cuda" else None
    form = plan.form if plan else (needs.choose_engine_form(p, shapes, device, prompt, card)[0] if engine else None)
    est = memory.estimate(p, shapes, device, prompt, engine=plan)
    s = shapes
    print(f"memory: one training step on {device} ({est.dtype} compute), estimated")
    print(f"  model: {s.source}: {s.total_params / 1e9:.3g} B params, {s.layers} layers, hidden {s.hidden}, "
          f"intermediate {s.intermediate}, {s.heads} heads / {s.kv_heads} kv heads x {s.head_dim}, vocab {s.vocab}")
    print(f"  shape: {p.train.rollouts.prompts_per_step} prompts x G={p.train.rollouts.group_size}, prompt {prompt} tokens ({how}) "
          f"+ {p.train.rollouts.max_new_tokens} new tokens (all full length)")
    print(f"  card: {card_how}")
    print(f"  rollouts: {rollouts_line(p, engine, form)}")
    if plan is not None:
        print(f"  engine: train.rollouts.engine_weights {p.train.rollouts.engine_weights} -> {plan.form} ({plan.why}); max_num_seqs "
              f"{plan.seqs}, max_num_batched_tokens {plan.batched_tokens}, enforce_eager")
        print("\n".join(f"  {line}" for line in memory.format_engine(plan, shapes)))
    print("\n".join(memory.format_table(est)))
    for line in memory.measured_for(p, shapes, device, prompt):
        print(f"  {line}")
    if device != "cuda":
        return 0
    saved = saved_model_plans(p, res.root, shapes, device, (prompt, how), bool(args.prompt_tokens), card)
    if card is not None:
        print("\n".join(stage_verdicts(p, shapes, device, prompt, card, saved, plan, est)))
    print("\n".join(format_times(p, shapes, prompt)))
    return 0


def stage_verdicts(p: Params, shapes, device: str, prompt: int, card: int, saved: dict, plan, est) -> list[str]:
    """``grpo check``'s verdict per stage on a card of ``card`` bytes: each saved-model engine's
    (``saved``: ``saved_model_plans``' result) and the train stage's (``plan``, ``est``)."""
    from grpo.rollout.engine.needs import other_plans
    from grpo.tools import memory

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
    others = other_plans(p, shapes, device, prompt, plan) if plan is not None else []  # the advice's other forms
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
    from grpo.rollout.engine.needs import longest_prompt_tokens
    from grpo.rollout.rollout_backends import uses_engine
    from grpo.tools import memory

    out = {}
    for section, stages in memory.SAVED_MODEL_STAGES:
        if not uses_engine(getattr(p, section).backend):
            continue
        tokens, how = prompt
        if section == "evaluate" and not given:
            found = longest_prompt_tokens(p, root, (p.evaluate.test_path,))
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
    from grpo.rollout.sampling import plan_decode

    try:
        train = plan_decode(p.decode, device, p.train.steps * p.train.rollouts.max_new_tokens).why
    except ValueError as err:
        return f"error: {err}"
    train = "a vLLM engine samples (train.rollouts.backend)" if engine else train
    return (f"train: {train}; sent and evaluate (where the decode loop samples): the same rule, with their own "
            "token steps (rows / batch_prompts x max_new_tokens), logged at their start")


def rollouts_line(p: Params, engine: bool, form: str | None) -> str:
    """What each training process samples with, as the train stage logs it (``rollouts_per_process``)."""
    from grpo.rollout.engine.forms import rollouts_per_process

    return f"{rollouts_per_process(engine, p.train.distribution.num_processes, form)} (train.rollouts.backend {p.train.rollouts.backend})"


def card_bytes(gpu_memory: float | None, device: str) -> tuple[int | None, str]:
    """The card's total memory in bytes (``--gpu-memory`` GiB, else this machine's card on CUDA) and
    where it came from."""
    if device != "cuda":
        return None, "none (a CPU estimate)" + (": --gpu-memory applies to --device cuda" if gpu_memory else "")
    if gpu_memory is not None:
        return int(gpu_memory * 2**30), f"{gpu_memory:g} GiB (--gpu-memory)"
    import torch

    if torch.cuda.is_available():
        total = torch.cuda.mem_get_info()[1]
        return total, f"{total / 2**30:.2f} GiB (this machine's)"
    return None, "unknown: --gpu-memory GIB for the engine's budget and a verdict"


# ------------------------------------------------------------------------------------- ask
def cmd_ask(args) -> int:
    from grpo.algorithm.rewards import extract_answer
    from grpo.tools import ask

    res = resolve_params(args.params)
    p = res.params
    model_path = res.root / p.model.path
    adapter = Path(args.adapter) if args.adapter else None
    ask.check_dirs(model_path, adapter)
    max_new = args.max_new_tokens or p.evaluate.max_new_tokens
    model_cfg = p.model.model_copy(update={"path": str(model_path)})
    model, tok, how = ask.load_for_answering(model_cfg, adapter)
    print(f"[{model_path}{f' + {adapter}' if adapter else ''}: {how}; greedy, <= {max_new} new tokens]",
          file=sys.stderr, flush=True)
    text = ask.answer(model, tok, args.question, p.train.system_prompt, max_new, out=sys.stdout)
    found = extract_answer(text)
    print()
    print(f"answer: {found if found is not None else '(none)'}")
    return 0


# ------------------------------------------------------------------------------------- doctor
def stage_needs(p: Params, root: Path, card: int) -> dict[str, int]:
    """What each stage needs free on a card of ``card`` bytes, as this process measures free memory
    (its own CUDA context already taken): a saved-model engine (SENT, the evaluations) its
    ``gpu_memory_utilization x card``, below which vLLM refuses to start, plus the CUDA contexts
    beside it beyond one (``grpo.tools.memory.saved_model_contexts``, as ``grpo check``'s verdict); the
    train stage the estimated peak of one step (``grpo check``'s). Empty where the model's shapes
    are unknown."""
    from grpo.rollout.engine.needs import engine_plan, longest_prompt_tokens
    from grpo.rollout.rollout_backends import uses_engine
    from grpo.tools import memory

    shapes = memory.resolve_shapes(p.model, root)
    if isinstance(shapes, str):
        return {}
    needs = {", ".join(stages): int(getattr(p, section).gpu_memory_utilization * card)
             + (memory.saved_model_contexts(section) - 1) * memory.CUDA_CONTEXT
             for section, stages in memory.SAVED_MODEL_STAGES if uses_engine(getattr(p, section).backend)}
    found = longest_prompt_tokens(p, root)
    prompt = found[0] if found else DEFAULT_PROMPT_TOKENS
    plan = engine_plan(p, shapes, "cuda", prompt, card) if uses_engine(p.train.rollouts.backend) else None
    needs["train"] = memory.estimate(p, shapes, "cuda", prompt, engine=plan).peak
    return needs


def cmd_doctor(args) -> int:
    from grpo.rollout.engine.preflight import run_preflight

    if args.estimate_gib is not None:
        estimate = int(args.estimate_gib * 2**30)
    elif args.params is not None:
        res = resolve_params(args.params)
        estimate = lambda total: max(stage_needs(res.params, res.root, total).values(), default=None)  # noqa: E731
    else:
        estimate = None
    report = run_preflight(estimate)
    print("\n".join(report.lines()))
    line = report.error_line()
    if line is not None:
        print(f"grpo doctor: error: {line}", file=sys.stderr)
        return 2
    return 0


# ------------------------------------------------------------------------------------- wiring
def package_version() -> str:
    """The installed ``grpo`` package's version, else pyproject.toml's (a source tree on PYTHONPATH)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("grpo")
    except PackageNotFoundError:
        import tomllib

        try:
            return tomllib.loads((Path(__file__).resolve().parents[3] / "pyproject.toml").read_text())["project"]["version"]
        except (OSError, KeyError, tomllib.TOMLDecodeError):
            return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo", description="GRPO pipeline tools: check params, ask the model, "
                                     "check a GPU machine.")
    parser.add_argument("--version", action="version", version=f"grpo {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="validate params; settings, device, DVC status, memory estimate")
    check.add_argument("--params", default="params.yaml", help="params file or preset (default: params.yaml)")
    check.add_argument("--device", choices=["cpu", "cuda"], help="estimate for this device (default: this machine's)")
    check.add_argument("--gpu-memory", type=float, metavar="GIB",
                       help="the card's total memory in GiB, as the card reports it (torch.cuda.mem_get_info's "
                       "total; an '8 GB' card reports about 7.6-7.8): the engines' budgets and a verdict per "
                       "stage (default: this machine's card)")
    check.add_argument("--prompt-tokens", type=int, help="prompt length for the estimate (default: the longest "
                       f"training prompt when data and tokenizer exist, else {DEFAULT_PROMPT_TOKENS})")
    check.set_defaults(func=cmd_check)
    ask = sub.add_parser("ask", help="answer a question greedily with the base model (+ a LoRA adapter)")
    ask.add_argument("question")
    ask.add_argument("--adapter", help="trained LoRA adapter directory (PEFT format, e.g. models/adapter)")
    ask.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    ask.add_argument("--max-new-tokens", type=int, help="length cap (default: evaluate.max_new_tokens)")
    ask.set_defaults(func=cmd_ask)
    doctor = sub.add_parser("doctor", help="check this machine for a GPU run: driver, compute capability, compiler, "
                            "Python headers, free GPU memory, the FlashInfer sampler (one line each)")
    doctor.add_argument("--estimate-gib", type=float, metavar="GIB",
                        help="the run's estimated peak GPU memory in GiB (grpo check --device cuda prints it): "
                        "compared with the card's free memory")
    doctor.add_argument("--params", metavar="FILE", help="without --estimate-gib: compare free memory with the "
                        "largest need of this params file's stages on this card (what scripts/pipeline.sh does)")
    doctor.set_defaults(func=cmd_doctor)
    return parser


def _quiet() -> None:
    """Library chatter (progress bars, load reports, warnings) off: stdout is the command's."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    import warnings

    warnings.filterwarnings("ignore")
    logging.basicConfig(level=logging.ERROR)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    for flag in ("prompt_tokens", "max_new_tokens"):
        value = getattr(args, flag, None)
        if value is not None and value < 1:
            print(f"grpo {args.command}: error: --{flag.replace('_', '-')}: must be >= 1", file=sys.stderr)
            return 2
    if getattr(args, "question", None) is not None and not args.question.strip():
        print(f"grpo {args.command}: error: the question is empty; ask one, e.g. grpo ask \"What is 2 + 3?\"",
              file=sys.stderr)
        return 2
    for flag in ("gpu_memory", "estimate_gib"):
        value = getattr(args, flag, None)
        if value is not None and not value > 0:
            print(f"grpo {args.command}: error: --{flag.replace('_', '-')}: must be > 0 GiB", file=sys.stderr)
            return 2
    _quiet()
    try:
        return args.func(args)
    except (ParamsError, DataError, ModelConfigError, DeviceError, FileNotFoundError) as err:
        print(f"grpo {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
