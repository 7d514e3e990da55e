"""One builder of a trainer: ``build_trainer(params, device, problems=...)`` makes what the train
stage runs, and every bench that trains calls it, so a bench measures exactly what the stage runs.

The order is the stage's, and so is every use of the RNG: the seed (``train.seed``), the
tokenizer, the prompts that fit the engine (``grpo.data.prompts_that_fit``), the policy
(``grpo.lora_policy.load_policy``: LoRA's initial weights are drawn here), the step loggers, the
engine's bounds (``grpo.engine.bounds.train_bounds``), the rollout backend
(``grpo.engine.policy_engine.policy_rollouts``) and ``grpo.trainer.GRPOTrainer``.

A bench's departures from the params (a token rule, ``mu``, sizes) are params too: ``depart(params,
{"train.optimizer.mu": 1})`` returns validated params with those keys replaced, and ``departure_line`` words
them for the bench to print. What a bench changes beyond params (a model already built, fixed
prompt or completion lengths) is an argument of ``build_trainer``, named there.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from grpo.base_model import load_tokenizer
from grpo.config import Params
from grpo.data import prompts_that_fit
from grpo.device import compute_dtype
from grpo.distributed import Dist
from grpo.engine.bounds import Bounds, train_bounds
from grpo.engine.forms import rollouts_per_process
from grpo.engine.needs import form_here
from grpo.engine.policy_engine import PolicyEngineSpec, policy_rollouts
from grpo.errors import ParamsError
from grpo.lora_policy import load_policy
from grpo.rollout_backends import DecodeChoice, RolloutBackend, uses_engine
from grpo.trainer import GRPOTrainer
from grpo.types import Lengths


@dataclass
class BuiltTrainer:
    """A trainer and what was built for it."""

    trainer: GRPOTrainer
    tokenizer: object
    model: object  # the peft policy
    backend: RolloutBackend
    problems: list[dict]  # the training rows whose prompts fit the engine
    bounds: Bounds
    weights_form: str | None  # the engine's weights form; None: the decode loop samples
    rollouts: str  # how the processes' rollouts are made (``grpo.engine.forms.rollouts_per_process``)
    backend_start_s: float  # seconds the backend took to start (an engine's start-up)
    closers: list = field(default_factory=list)  # the step loggers' closers (``grpo.step_loggers``)


def depart(params: Params, departures: dict[str, object]) -> Params:
    """``params`` with each dotted key of ``departures`` (``{"train.optimizer.mu": 1}``, any depth)
    replaced, each changed section built again, so validated (``ParamsError`` of one line on a bad
    value or key). A key names a section and a key in it; ``params`` is left as it was."""
    from grpo.overlay import overlay_params

    sections = {name: getattr(params, name) for name in type(params).model_fields} | dict(params.model_extra or {})
    names = {key.partition(".")[0] for key in departures}
    for key in departures:
        name, dot, rest = key.partition(".")
        if name not in sections or not dot or not rest:
            raise ParamsError(f"{name}: a departure names a section and a key of it (section.key); "
                              f"sections: {', '.join(sections)}")
    raw = overlay_params({name: sections[name].model_dump() for name in names}, departures)
    for name in names:
        sections[name] = type(sections[name])(**raw[name])
    return type(params)(**sections)


def _form(params: Params, device: str) -> str:
    """The training engine's weights form on this machine; ``dense`` where the decode loop samples."""
    return form_here(params, Path("."), device)[0] if uses_engine(params.train.rollouts.backend) else "dense"


def departure_line(departures: dict[str, object]) -> str:
    """The departures from the params, as a bench prints them: ``train.optimizer.mu=1, train.steps=3``, or
    ``none`` (the params as the stage runs them)."""
    return ", ".join(f"{k}={v}" for k, v in departures.items()) or "none"


def build_trainer(params: Params, device: str, *, problems: list[dict], dist: Dist | None = None,
                  loggers: Callable[[], tuple[list, list]] | None = None, val_problems: list[dict] | None = None,
                  engine_dir: str | Path | None = None, form: str | None = None, model=None, tokenizer=None,
                  max_prompt_tokens: int | None = None, min_new_tokens: int = 0,
                  source: str | Path | None = None, backend: RolloutBackend | None = None) -> BuiltTrainer:
    """The train stage's trainer for ``params`` on ``device`` over ``problems`` (module docstring
    for the order). ``dist``: this process among the data-parallel ones (one process when
    ``None``); ``loggers``: makes the step loggers' callbacks and closers, called where the stage
    makes them (``grpo.step_loggers.step_loggers``; none when ``None``); ``val_problems``: the
    validation rows (``train.checkpoints.eval_every``); ``engine_dir``: the engine's folder (``train.output_dir``
    /engine); ``form``: the engine's weights form (default: ``grpo.engine.needs.form_here``'s choice
    for this machine); ``source``: the rows' file, for the message about prompts that do not fit
    (``train.data_path``).

    A bench's departures beyond params: ``model``, ``tokenizer`` (already built: not loaded, and no
    seed is set for them), ``max_prompt_tokens`` and ``min_new_tokens`` (rollouts of fixed lengths),
    ``backend`` (a rollout backend already made, for a bench whose rollout phase is replaced: then
    none is started here).
    When the trainer cannot be made, the backend is closed before the error goes on."""
    cfg, dist = params.train, dist or Dist()
    if model is None:
        torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(params.model.path) if tokenizer is None else tokenizer
    if max_prompt_tokens is None:  # else the backend cuts every prompt to that length: none is dropped
        problems, _ = prompts_that_fit(tokenizer, problems, cfg.system_prompt, cfg.rollouts, source or cfg.data_path)
    model = load_policy(params.model, params.lora, device) if model is None else model
    callbacks, closers = loggers() if loggers is not None else ([], [])
    bounds = train_bounds(cfg, model.config, device, compute_dtype(params.model.dtype, device).itemsize,
                          dist.world_size)
    t0 = time.perf_counter()
    if backend is None:
        engine = PolicyEngineSpec(Path(engine_dir or Path(cfg.output_dir) / "engine"), cfg.rollouts, params.model,
                                  form or _form(params, device), bounds, cfg.seed, params.model.dtype)
        backend = policy_rollouts(cfg.rollouts.backend, tokenizer, model, engine=engine, dist=dist,
                                  limits=Lengths(max_prompt_tokens, min_new_tokens),
                                  decode=DecodeChoice(params.decode, cfg.steps * cfg.rollouts.max_new_tokens))
    backend_start_s = time.perf_counter() - t0
    weights_form = getattr(backend, "weights_form", None)  # None: no engine (the decode loop)
    try:
        trainer = GRPOTrainer(model, tokenizer, cfg, problems, backend=backend, callbacks=callbacks,
                              val_problems=val_problems, dist=dist)
    except BaseException:
        backend.close()  # an engine started for a trainer that failed gives its memory back
        raise
    return BuiltTrainer(trainer, tokenizer, model, backend, problems, bounds, weights_form,
                        rollouts_per_process(weights_form is not None, dist.world_size, weights_form),
                        backend_start_s, closers)

