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

This module imports no torch, so ``--help`` and ``--version`` answer at once. What a command's work
needs beyond the params is imported once they are valid: ``check``'s report and ``doctor --params``'s
stage needs (``grpo.tools.check_report``), ``ask``'s model (``grpo.tools.ask``).

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

from grpo.algorithm.rewards import extract_answer
from grpo.config.overlay import overlay_params
from grpo.config.params import params_from_dict
from grpo.config.reading import Params, read_params_yaml
from grpo.core.dvcfile import find_root
from grpo.core.errors import DeviceError, ModelConfigError, ParamsError
from grpo.core.jsonio import DataError
from grpo.rollout.engine.preflight import run_preflight
from grpo.tools.dvcstatus import flat_keys


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
    new, old = flat_keys(params.model_dump()), flat_keys(before.model_dump())
    changed = [k for k in new if new[k] != old.get(k)]
    return Resolved(params, root, f"{path} put over {base_path}", changed)


# ------------------------------------------------------------------------------------- check
def cmd_check(args) -> int:
    res = resolve_params(args.params)  # before the report's modules are imported: a bad file fails in seconds
    # lazy: check_report loads torch (the estimate, the engines' needs); --help and a bad file need none of it
    from grpo.tools import check_report

    return check_report.check(res, args.device, args.gpu_memory, args.prompt_tokens)


# ------------------------------------------------------------------------------------- ask
def cmd_ask(args) -> int:
    res = resolve_params(args.params)
    # lazy: ask loads torch and the model code (lora_policy); --help and a bad params file need neither
    from grpo.tools import ask

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
def cmd_doctor(args) -> int:
    if args.estimate_gib is not None:
        estimate = int(args.estimate_gib * 2**30)
    elif args.params is not None:
        res = resolve_params(args.params)
        # lazy: check_report (torch, the memory estimate) serves --params alone; a bad params file is refused before it
        from grpo.tools.check_report import stage_needs

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
                       "training prompt when data and tokenizer exist, else 128)")  # check_report.DEFAULT_PROMPT_TOKENS
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
